"""`--lora-adapters N --lora-rank R` of `tessellm bench throughput` and `bench latency`:
N seeded random PEFT adapters of rank R over the engine's own model (every q/k/v/o/gate/up/
down projection, alpha = 2R), written in PEFT's file format to a temporary directory, and the
LoRARequests that name them. Requests use them round-robin (request i: adapter i mod N), so
with 64 prompts and 4 adapters every step mixes all four."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tessellm.errors import ConfigError


def lora_options(a: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Engine options with LoRA on when adapters are asked for (max_loras = N, rank R)."""
    n = getattr(a, "lora_adapters", 0) or 0
    if n <= 0:
        return options
    return {"enable_lora": True, "max_loras": n, "max_lora_rank": a.lora_rank, **options}


def random_adapters(llm: Any, n: int, rank: int, seed: int = 0,
                    b_scale: float = 0.01) -> list[Any]:
    """N adapters over `llm`'s model as LoRARequests (files under a temporary directory that
    lives as long as the process); B's entries are N(0, b_scale^2)."""
    from tessellm import LoRARequest
    sites = llm.engine.parts.lora_sites
    if not sites:
        raise ConfigError("--lora-adapters needs an engine with enable_lora")
    root = Path(tempfile.mkdtemp(prefix="tessellm-bench-lora-"))
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(n):
        tensors = {}
        for site in sites:
            where = "self_attn" if site.role in ("q_proj", "k_proj", "v_proj", "qkv_proj",
                                                 "o_proj") else "mlp"
            for part in site.parts:
                key = f"base_model.model.model.layers.{site.layer}.{where}.{part.module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(
                    (rank, site.in_features), generator=gen) * site.in_features ** -0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(
                    (part.out_features, rank), generator=gen) * b_scale
        directory = root / f"adapter{i}"
        directory.mkdir()
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
             "target_modules": sorted({p.module for s in sites for p in s.parts})}))
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(directory)))
    return requests
