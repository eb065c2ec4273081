"""A Qwen3-MoE-shaped model with random weights (1.2B parameters in all, 0.44B read per
token with the LM head, 0.28B without), and a dense Qwen3 of the same active size, for the
mixture-of-experts figures (issue: model families):

  python make_moe_bench_model.py OUT_DIR [--dense]
  tessellm convert OUT_DIR OUT_DIR/f16.gguf
  /tmp/lcpp/bin/python -c "import llama_cpp as l; p = l.llama_model_quantize_default_params();
      p.ftype = 15; l.llama_model_quantize(b'OUT_DIR/f16.gguf', b'OUT_DIR/q4_k_m.gguf', p)"

Shape: hidden 1024, 16 layers, 16 query heads of 128 over 4 KV heads, q/k norms; MoE: 32
experts of 512 features, top-8, renormalized (Qwen3-30B-A3B's routing, scaled down); dense:
one MLP of 4096 features (= 8 x 512). The vocabulary and tokenizer are Qwen3's
(../shared/tokenizers/qwen3). Weights N(0, 0.02) (transformers' initializer), bf16.
"""
import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3MoeConfig

SHARED = Path(__file__).resolve().parents[4] / "shared"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "qwen3"))
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    common = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=False, eos_token_id=tok.eos_token_id)
    if a.dense:
        config = Qwen3Config(intermediate_size=4096, **common)
    else:
        config = Qwen3MoeConfig(intermediate_size=4096, moe_intermediate_size=512,
                                num_experts=32, num_experts_per_tok=8, norm_topk_prob=True,
                                **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}: {n / 1e9:.2f} B parameters")
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)


if __name__ == "__main__":
    main()
