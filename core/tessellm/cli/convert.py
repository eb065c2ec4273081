"""`tessellm convert HF_DIR OUT.gguf`: the command line of tessellm.models.gguf_convert."""
from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add `convert` to the top-level subparsers, its handler set."""
    p = sub.add_parser("convert", help="write a Hugging Face safetensors model (Llama, "
                       "Mistral, Qwen2/3) as a GGUF file that llama.cpp reads and quantizes")
    p.add_argument("model_dir", help="HF model directory (config.json, *.safetensors, "
                   "tokenizer.model or tokenizer.json)")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--outtype", default="f16", choices=["f16", "bf16", "f32"],
                   help="type of the matrices (norms stay f32)")
    p.set_defaults(func=cmd_convert)
    return p


def cmd_convert(a: argparse.Namespace) -> int:
    from tessellm.models.gguf_convert import convert_hf_to_gguf
    path = convert_hf_to_gguf(a.model_dir, a.out, a.outtype)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0
