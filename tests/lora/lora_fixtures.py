"""Random-weight base models (tests/models/hf_fixtures cases) and PEFT LoRA adapters over
them, built with `peft` and saved as PEFT saves them (adapter_config.json +
adapter_model.safetensors).

PEFT initializes lora_B to zero (an adapter that changes nothing); `make_adapter` redraws
every LoRA weight from a seeded generator so each adapter changes the model's outputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_fixtures import CASES, build_hf_model, save_model_dir

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_STD = 0.2


@dataclass
class BaseModel:
    case: str
    directory: Path
    tokenizer: Any
    hf: torch.nn.Module


def make_base(case: str, out: Path) -> BaseModel:
    c = CASES[case]
    tok = c.tokenizer()
    hf = build_hf_model(c, tok)
    save_model_dir(hf, tok, out)
    return BaseModel(case, out, tok, hf)


def make_adapter(base: BaseModel, out: Path, seed: int, rank: int = 8,
                 targets: tuple[str, ...] = ALL_MODULES, alpha: float | None = None,
                 use_rslora: bool = False) -> torch.nn.Module:
    """Save a PEFT adapter of `base` to `out`; returns the PeftModel (eval, float32)."""
    from peft import LoraConfig, get_peft_model
    model = build_hf_model(CASES[base.case], base.tokenizer)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=list(targets), lora_dropout=0.0, use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters(), key=lambda kv: kv[0]):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * LORA_STD)
    peft_model.save_pretrained(str(out))
    return peft_model.eval()
