"""Writes a Hugging Face Llama directory (e.g. stories260K-hf) in Meta's original layout, to
try the tutorial's plugin on: the inverse of tessellm_meta_llama's adapter.

    python docs/examples/new_architecture/make_checkpoint.py HF_DIR OUT_DIR
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def convert(hf_dir: Path, out_dir: Path) -> None:
    hf = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    out_dir.mkdir(parents=True, exist_ok=True)
    for tokenizer_file in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        if (hf_dir / tokenizer_file).exists():
            shutil.copy(hf_dir / tokenizer_file, out_dir / tokenizer_file)
    (out_dir / "config.json").write_text(json.dumps({
        "architectures": ["MetaLlamaForCausalLM"], "dim": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"], "n_heads": heads, "n_kv_heads": kv_heads,
        "vocab_size": hf["vocab_size"], "hidden_dim": hf["intermediate_size"],
        "norm_eps": hf["rms_norm_eps"], "max_seq_len": hf["max_position_embeddings"],
        "rope_theta": hf.get("rope_theta", 10000.0), "torch_dtype": hf.get("torch_dtype"),
        "bos_token_id": hf.get("bos_token_id"), "eos_token_id": hf.get("eos_token_id")}, indent=1))
    hf_weights = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        hf_weights.update(load_file(f))
    meta = {"tok_embeddings.weight": hf_weights["model.embed_tokens.weight"],
            "norm.weight": hf_weights["model.norm.weight"],
            "output.weight": hf_weights.get("lm_head.weight",
                                            hf_weights["model.embed_tokens.weight"]).clone()}
    names = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
             "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
             "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
             "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
             "post_attention_layernorm": "ffn_norm"}
    for i in range(hf["num_hidden_layers"]):
        for hf_name, meta_name in names.items():
            w = hf_weights[f"model.layers.{i}.{hf_name}.weight"]
            if meta_name == "attention.wq":
                w = halves_to_pairs(w, heads)
            elif meta_name == "attention.wk":
                w = halves_to_pairs(w, kv_heads)
            meta[f"layers.{i}.{meta_name}.weight"] = w.contiguous()
    save_file(meta, str(out_dir / "model.safetensors"))


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
