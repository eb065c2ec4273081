"""Portable `lora_add` (tessellm.kernels.reference_lora states the op): every slot's
low-rank projection for every row, then a one-hot mask keeps each row's own slot's columns.

Two GEMMs of width S * R (max_loras times the site's rank) per site, whatever the batch
holds, no host reads and shapes that depend on the input shapes only: graph capture and XLA
take it as it is. Columns of other slots are multiplied by an exact zero, so a row's result
is its own slot's term (and y itself for slot -1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def lora_add_dense_slots(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    num_slots, rank, in_f = a.shape
    rows = x.shape[0]
    shrunk = F.linear(x.to(a.dtype), a.view(num_slots * rank, in_f)).view(rows, num_slots, rank)
    own = slots.unsqueeze(1) == torch.arange(num_slots, device=slots.device).unsqueeze(0)
    shrunk = shrunk * own.unsqueeze(-1).to(shrunk.dtype)
    delta = shrunk.view(rows, num_slots * rank) @ b.view(num_slots * rank, b.shape[2])
    return y + delta.to(y.dtype)
