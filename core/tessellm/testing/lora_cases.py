"""Conformance cases of `lora_add` (tessellm.kernels.reference_lora): every slot and
base-model rows (-1) mixed in one batch, one adapter on every row, no adapter at all; fused
sites' widths (several parts' ranks side by side); empty, single-token and prefill-sized
batches."""
from __future__ import annotations

import torch

from tessellm.testing.kernel_cases import DTYPES, CaseInputs, KernelCase, _case

LORA_ROW_COUNTS = (0, 1, 7, 20)
LORA_SHAPES = ((64, 48, 4, 16), (32, 96, 1, 24), (48, 64, 3, 8))  # (in, out, slots, rank)
SLOT_MIXES = ("mixed", "one", "none")


def _slots(mix: str, rows: int, num_slots: int, g: torch.Generator) -> torch.Tensor:
    if mix == "one":
        return torch.full((rows,), num_slots - 1, dtype=torch.int64)
    if mix == "none":
        return torch.full((rows,), -1, dtype=torch.int64)
    return torch.randint(-1, num_slots, (rows,), generator=g)


def lora_cases() -> list[KernelCase]:
    out = []
    for dt in DTYPES:
        for T in LORA_ROW_COUNTS:
            for i, o, S, R in LORA_SHAPES:
                for mix in SLOT_MIXES:
                    def build(g, dt=dt, T=T, i=i, o=o, S=S, R=R, mix=mix):
                        def rand(shape, scale=1.0):
                            return (torch.randn(shape, generator=g) * scale).to(dt)
                        return CaseInputs([rand((T, i)), rand((T, o)),
                                           rand((S, R, i), i ** -0.5),
                                           rand((S, R, o), R ** -0.5), _slots(mix, T, S, g)])
                    dims = {"in_features": i, "out_features": o, "slots": S, "rank": R}
                    out.append(_case("lora_add", dt, T, dims, f"in={i} out={o} S={S} R={R} "
                                     f"{mix}", build))
    return out
