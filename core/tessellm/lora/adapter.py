"""A PEFT LoRA adapter read from its directory (or a hub repo id) and checked against the base
model: `adapter_config.json` + `adapter_model.safetensors`.

What is read: `r`, `lora_alpha`, `use_rslora` (scaling alpha / r, or alpha / sqrt(r)),
`target_modules` (informational: the tensors decide), and every tensor
`base_model.model.model.layers.<i>.(self_attn|mlp).<module>.lora_(A|B).weight` for the
modules tessellm.lora.sites can serve (q/k/v/o/gate/up/down). Refused with a LoRAError that
names the cause: a missing or unreadable file, a corrupt safetensors file, a rank above
max_lora_rank, a module or layer the base model lacks, shapes that do not match it, a tensor
that is not a plain lora_A/lora_B weight (embeddings, lm_head, DoRA magnitudes, biases),
`modules_to_save`, `use_dora`, per-module rank or alpha patterns, a non-LoRA PEFT type.

Invariant: `weights[(layer, module)] = (A [r, in], B * scaling [out, r])` in float32 with r
the module's own rank <= max_lora_rank; every module an adapter names is in the base model.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tessellm.lora.adapter_config import (WEIGHTS_FILE, LoRAError, adapter_directory,
                                          read_adapter_config)
from tessellm.lora.request import LoRARequest

_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    int_id: int
    rank: int          # the largest module rank
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    path: str = ""     # where it was read (a tensor-parallel worker reads it there too)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ab in self.weights.values() for t in ab)


def _read_tensors(directory: Path, name: str) -> dict[str, torch.Tensor]:
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        other = " (adapter_model.bin is not read: convert it to safetensors)" \
            if (directory / "adapter_model.bin").exists() else ""
        raise LoRAError(f"adapter {name!r}: {path} not found{other}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS_FILE} is not a readable safetensors "
                        f"file ({e})") from None


def load_adapter(request: LoRARequest, shapes: dict[tuple[int, str], tuple[int, int]],
                 max_rank: int) -> LoRAAdapter:
    """Read and check `request`'s adapter; `shapes`: (layer, module) -> (in, out) of the base
    model's linears that can take one (tessellm.lora.sites.module_shapes)."""
    name = request.lora_name
    directory = adapter_directory(request.lora_path)
    config = read_adapter_config(directory, name)
    tensors = _read_tensors(directory, name)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"adapter {name!r}: tensor {key!r} is not a lora_A / lora_B "
                            "weight of a layer's q/k/v/o/gate/up/down projection (not "
                            "supported)")
        layer, module, side = int(m.group(1)), m.group(2), m.group(3)
        if (layer, module) not in shapes:
            raise LoRAError(f"adapter {name!r}: target module {module!r} of layer {layer} "
                            "is not in the base model (or cannot take an adapter)")
        pairs.setdefault((layer, module), {})[side] = tensor
    if not pairs:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    alpha, use_rslora = float(config["lora_alpha"]), bool(config.get("use_rslora", False))
    weights, top_rank = {}, 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"adapter {name!r}: layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{where} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        in_f, out_f = shapes[(layer, module)]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f \
                or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                            f"not fit the base linear ({out_f} x {in_f})")
        rank = int(a.shape[0])
        if rank > max_rank:
            raise LoRAError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
        scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
        weights[(layer, module)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
        top_rank = max(top_rank, rank)
    r = int(config["r"])
    return LoRAAdapter(name, request.lora_int_id, top_rank,
                       alpha / (math.sqrt(r) if use_rslora else r), weights, request.lora_path)
