"""Reference of `lora_add`, the op a LoRA site runs after its linear (tessellm.lora.sites).

    lora_add(x [T, in], y [T, out], a [S, R, in], b [S, R, out], slots [T] int64) -> [T, out]

Row t with slot s = slots[t] >= 0 gets y[t] + (x[t] @ a[s]^T) @ b[s]; a row with slot -1
(the base model) is y[t] exactly. Computed in x's dtype (the activations'), as PEFT computes
a LoRA layer in its weights' dtype, which the adapter shares with the base model.
"""
from __future__ import annotations

import torch


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
    out = y.clone()
    for s in sorted(set(slots.tolist())):
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        xs = x.index_select(0, rows).to(a.dtype)
        delta = (xs @ a[s].T) @ b[s]
        out.index_copy_(0, rows, (y.index_select(0, rows) + delta.to(y.dtype)))
    return out
