"""Random-weight Hugging Face models of real shapes, for parity tests against transformers.

Every model is small (hidden 64, 2 layers) but has the real vocabulary of its family's tokenizer,
so embedding and LM-head shapes, special tokens and tokenization are the real ones. A model is
deterministic: the same case always gives the same weights (its own torch.Generator, seeded per
case), whatever else ran before.

Weights are drawn by `randomize_weights`, not by transformers' initializer: HF initializes norm
weights to 1 and biases to 0, which would leave norm and bias loading untested. Matrices get
N(0, MATRIX_STD); 1-d norm weights 1 + N(0, 0.1); biases N(0, 0.1). With hidden 64 and
MATRIX_STD 0.12 the logits have std ~1: greedy decoding wanders over many tokens instead of
collapsing at once, and the top-2 margin is far above float32 noise.

Tokenizers come from ../shared/tokenizers (see its README). The GPT-2 vocabulary exists only
as a vocab-only GGUF there; transformers reads it through the `gguf` package (a test extra;
checked against llama.cpp's reference ids in test_hf_parity.py).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# shared/ sits beside the repository (CI lays a copy there); /work/shared on the dev machines;
# TESSELLM_SHARED_DIR where neither is (scripts/gpu_check.sh on a GPU machine).
_BESIDE = Path(__file__).resolve().parents[2].parent / "shared"
SHARED = Path(os.environ["TESSELLM_SHARED_DIR"]) if os.environ.get("TESSELLM_SHARED_DIR") \
    else _BESIDE if _BESIDE.is_dir() else Path("/work/shared")
TOKENIZERS = SHARED / "tokenizers"
STORIES_260K = SHARED / "models" / "stories260K-hf"
GPT2_GGUF = TOKENIZERS / "gguf-vocab" / "ggml-vocab-gpt-2.gguf"
PHI3_GGUF = TOKENIZERS / "gguf-vocab" / "ggml-vocab-phi-3.gguf"

MATRIX_STD = 0.12
VECTOR_STD = 0.1

def gpt2_tokenizer_from_gguf(path: str | Path = GPT2_GGUF) -> Any:
    """GPT-2's byte-level BPE tokenizer (50257 tokens) from the vocab-only GGUF."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)


# --------------------------------------------------------------------------- tokenizers


def llama3_tokenizer() -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(TOKENIZERS / "llama3"))


def llama2_tokenizer() -> Any:
    """Llama 2's SentencePiece vocabulary (Mistral v0.1 uses the same 32000-token layout)."""
    from transformers import LlamaTokenizer
    return LlamaTokenizer.from_pretrained(str(TOKENIZERS / "llama2"), add_bos_token=True)


def qwen3_tokenizer() -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(TOKENIZERS / "qwen3"))


def phi3_tokenizer() -> Any:
    """Phi-3's SentencePiece vocabulary (32064 tokens) from llama.cpp's vocab-only GGUF."""
    return gpt2_tokenizer_from_gguf(PHI3_GGUF)


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelCase:
    """One architecture variant: how to make its tokenizer and its config (given the vocab)."""

    name: str
    tokenizer: Callable[[], Any]
    config: Callable[[Any], Any]
    seed: int
    notes: str = ""


def _llama_config(tok: Any, **overrides: Any) -> Any:
    from transformers import LlamaConfig
    base = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    base.update(overrides)
    return LlamaConfig(**base)


def _llama3_rope_config(tok: Any) -> Any:
    # original_max_position_embeddings 32 puts the low/high-frequency cut-offs inside the
    # prompts' positions, so the scaling changes the logits (checked in the test).
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    return _llama_config(tok, rope_scaling=rope)


def _llama_yarn_config(tok: Any) -> Any:
    # an original length of 32 and factor 4: the interpolated frequencies and the attention
    # factor (0.1 ln 4 + 1) both change the logits of the test prompts
    rope = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
            "original_max_position_embeddings": 32}
    return _llama_config(tok, rope_scaling=rope, max_position_embeddings=128)


def _llama_dynamic_config(tok: Any) -> Any:
    # dynamic NTK past max_position_embeddings = 24: greedy generation runs past it
    rope = {"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 4.0}
    return _llama_config(tok, rope_scaling=rope, max_position_embeddings=24)


def _mistral_config(tok: Any) -> Any:
    from transformers import MistralConfig
    return MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=160,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, sliding_window=4096, rms_norm_eps=1e-5,
                         rope_theta=10000.0, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def _qwen2_config(tok: Any) -> Any:
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=True, use_sliding_window=False,
                       eos_token_id=tok.eos_token_id)


def _qwen3_config(tok: Any) -> Any:
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False,
                       eos_token_id=tok.eos_token_id)


# Mixture-of-experts cases: a router std ~1 (MATRIX_STD over hidden 64) spreads the tokens
# over the experts, so every expert is chosen by some token of the prompts.
def _mixtral_config(tok: Any) -> Any:
    from transformers import MixtralConfig
    return MixtralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=512, sliding_window=None, rms_norm_eps=1e-5,
                         rope_theta=1000000.0, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def _qwen2_moe_config(tok: Any) -> Any:
    from transformers import Qwen2MoeConfig
    # layer 1 keeps a dense MLP (mlp_only_layers); a shared expert with its sigmoid gate
    return Qwen2MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                          moe_intermediate_size=32, shared_expert_intermediate_size=64,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                          mlp_only_layers=[1], num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=512,
                          rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                          use_sliding_window=False, eos_token_id=tok.eos_token_id)


def _qwen3_moe_config(tok: Any) -> Any:
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                          moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                          norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                          rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                          use_sliding_window=False, eos_token_id=tok.eos_token_id)


# longrope as Phi-3-mini-128k / Phi-3.5-mini have it, original length 4: every prompt is
# longer, so transformers runs every call with the long factors, as tessellm's table does for
# a context (128) past the original length; the attention factor sqrt(1 + ln 32 / ln 4).
PHI3_SHORT_FACTOR = [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6]
PHI3_LONG_FACTOR = [1.0, 1.4, 2.0, 3.0, 4.5, 7.0, 11.0, 17.0]


def _phi3_config(tok: Any, **overrides: Any) -> Any:
    from transformers import Phi3Config
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": PHI3_SHORT_FACTOR,
            "long_factor": PHI3_LONG_FACTOR}
    base = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128, original_max_position_embeddings=4,
                rope_parameters=rope, sliding_window=2047, rms_norm_eps=1e-5,
                tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    base.update(overrides)
    return Phi3Config(**base)


# Sliding-window and soft-capping cases: a window of 8 keys is shorter than most prompts (and
# than every prompt plus its greedy tokens); soft-caps of 5 on scores and 10 on logits (std
# ~1-2, tails past 5) bite, and 10 leaves greedy margins wider than bf16 noise;
# 3 layers, so both sliding (0, 2) and full (1) layers occur.
SHORT_WINDOW = 8


def _mistral_window_config(tok: Any) -> Any:
    from transformers import MistralConfig
    return MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=160,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, sliding_window=SHORT_WINDOW,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def _gemma2_config(tok: Any) -> Any:
    from transformers import Gemma2Config
    return Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=512, sliding_window=SHORT_WINDOW,
                        query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                        final_logit_softcapping=10.0, rms_norm_eps=1e-6,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=0, attn_implementation="eager")


def _gemma3_config(tok: Any) -> Any:
    # layers sliding, full, sliding (pattern 2); the full layer's rope linear-scaled (x2) on
    # theta 1e6, the sliding layers' unscaled on 1e4
    from transformers import Gemma3TextConfig
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, max_position_embeddings=512,
                           sliding_window=SHORT_WINDOW, sliding_window_pattern=2,
                           query_pre_attn_scalar=24, rope_theta=1_000_000.0,
                           rope_local_base_freq=10_000.0,
                           rope_scaling={"rope_type": "linear", "factor": 2.0},
                           rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=0,
                           attn_implementation="eager")
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


def _gpt2_config(tok: Any) -> Any:
    from transformers import GPT2Config
    return GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


CASES: dict[str, ModelCase] = {c.name: c for c in (
    ModelCase("llama", llama3_tokenizer, _llama_config, 1, "GQA 4/2, untied head"),
    ModelCase("llama_rope3", llama3_tokenizer, _llama3_rope_config, 1,
              "same weights as llama, rope_type llama3"),
    ModelCase("llama_yarn", llama3_tokenizer, _llama_yarn_config, 1,
              "same weights as llama, rope_type yarn"),
    ModelCase("phi3", phi3_tokenizer, _phi3_config, 31,
              "fused qkv / gate_up, longrope past original length 4"),
    ModelCase("mistral", llama2_tokenizer, _mistral_config, 2, "SentencePiece 32000"),
    ModelCase("qwen2", qwen3_tokenizer, _qwen2_config, 3, "qkv bias, tied head"),
    ModelCase("qwen3", qwen3_tokenizer, _qwen3_config, 4, "q/k norm, head_dim 32 != 64/4"),
    ModelCase("gpt2", gpt2_tokenizer_from_gguf, _gpt2_config, 5, "LayerNorm, learned positions"),
    ModelCase("mistral_window", llama2_tokenizer, _mistral_window_config, 2,
              "same weights as mistral, sliding window of 8 on every layer"),
    ModelCase("gemma2", llama2_tokenizer, _gemma2_config, 6,
              "(1 + w) norms, GeGLU, window 8 on layers 0 and 2, soft-caps 5 and 10"),
    ModelCase("gemma3", llama2_tokenizer, _gemma3_config, 7,
              "q/k norms, local rope on sliding layers, linear-scaled global rope"),
    ModelCase("mixtral", llama2_tokenizer, _mixtral_config, 6, "4 experts, top-2"),
    ModelCase("qwen2_moe", qwen3_tokenizer, _qwen2_moe_config, 7,
              "8 experts, top-2 unnormalized, shared expert, one dense layer"),
    ModelCase("qwen3_moe", qwen3_tokenizer, _qwen3_moe_config, 8,
              "8 experts, top-3 renormalized, q/k norm"),
)}
# position-dependent rope (transformers recomputes it per forward call): tested apart
DYNAMIC_ROPE_CASE = ModelCase("llama_dynamic", llama3_tokenizer, _llama_dynamic_config, 1,
                              "same weights as llama, rope_type dynamic (NTK)")


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter from one generator, in name order (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() >= 2:
                values = torch.randn(p.shape, generator=gen) * MATRIX_STD
            elif name.endswith("bias"):
                values = torch.randn(p.shape, generator=gen) * VECTOR_STD
            else:  # RMSNorm / LayerNorm scale
                values = 1.0 + torch.randn(p.shape, generator=gen) * VECTOR_STD
            p.copy_(values)


def build_hf_model(case: ModelCase, tokenizer: Any) -> torch.nn.Module:
    """The float32 transformers model of `case`, random weights, in eval mode."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(case.config(tokenizer), dtype=torch.float32)
    randomize_weights(model, case.seed)
    return model.eval()


def save_model_dir(model: torch.nn.Module, tokenizer: Any, out_dir: Path) -> Path:
    """config.json + model.safetensors + the tokenizer's files, as a hub checkpoint has them."""
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


@torch.inference_mode()
def hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `ids`: exactly n tokens (EOS does not stop it)."""
    prompt = torch.tensor([ids])
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                      max_new_tokens=n, min_new_tokens=n)
    return out[0, len(ids):].tolist()
