"""The CPU's `lora_add` kernel that groups rows by adapter (tessellm.kernels.reference_lora
states the op; the portable one computes every slot for every row).

The slots are read on the host (free on the CPU); the rows of each adapter present are
gathered, shrunk and expanded through that adapter's own A and B only, and added back. A
step with one adapter on every row (one stream) needs no gather; a step without adapter rows
copies y.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def lora_add_grouped(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
    host = slots.tolist()
    present = set(host)
    present.discard(-1)
    if not present:
        return y.clone()
    if len(present) == 1 and host[0] >= 0 and host.count(host[0]) == len(host):
        s = host[0]
        return y + (F.linear(x.to(a.dtype), a[s]) @ b[s]).to(y.dtype)
    out = y.clone()
    for s in sorted(present):
        rows = (slots == s).nonzero().squeeze(1)
        delta = F.linear(x.index_select(0, rows).to(a.dtype), a[s]) @ b[s]
        out.index_add_(0, rows, delta.to(y.dtype))
    return out
