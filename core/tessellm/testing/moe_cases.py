"""Conformance cases of the mixture-of-experts ops: the router (softmax and sigmoid scoring,
with and without renormalization), the fused experts over float and packed stacked weights
(legacy blocks and K-quant super-blocks), with the skewed routings of
kernels.moe_examples (one expert takes every token, one takes none), and the shared expert's
sigmoid gate; empty, single-token and prefill-sized batches."""
from __future__ import annotations

import torch

from tessellm.kernels.moe_examples import moe_example
from tessellm.kernels.registry import KernelQuery
from tessellm.quant.formats import FORMATS_BY_NAME
from tessellm.testing.kernel_cases import DTYPES, CaseInputs, KernelCase, _case

MOE_ROW_COUNTS = (0, 1, 7, 20)
MOE_SHAPES = ((64, 32, 4, 2), (64, 48, 8, 3))         # (hidden, features, experts, top_k)
PACKED_MOE = (("Q8_0", "Q8_0", 64, 32), ("Q4_0", "Q8_0", 64, 32),
              ("Q4_K", "Q6_K", 256, 256))             # (gate/up, down, hidden, features)


def moe_cases(op: str) -> list[KernelCase]:
    out = []
    for dt in DTYPES:
        for T in MOE_ROW_COUNTS:
            for dims, tag in _dims(op):
                def build(g, op=op, dt=dt, T=T, dims=dims):
                    query = KernelQuery(op, dt, T, tuple(sorted(dims.items())))
                    return CaseInputs(moe_example(query, "cpu", g, {}))
                out.append(_case(op, dt, T, dims, tag, build))
    return out


def _dims(op: str) -> list[tuple[dict[str, int], str]]:
    if op == "moe_router":
        return [({"experts": e, "top_k": k, "renormalize": r, "sigmoid": s},
                 f"E={e} k={k} renorm={r} sigmoid={s}")
                for e, k in ((8, 2), (60, 4)) for r in (0, 1) for s in (0, 1)]
    if op == "sigmoid_gate":
        return [({"hidden": 64}, "hidden=64")]
    if op == "fused_moe":
        return [({"hidden": h, "features": i, "experts": e, "top_k": k}, f"E={e} k={k} I={i}")
                for h, i, e, k in MOE_SHAPES]
    return [({"hidden": h, "features": i, "experts": 4, "top_k": 2,
              "qtype": FORMATS_BY_NAME[a.lower()].ggml_type,
              "qtype_down": FORMATS_BY_NAME[b.lower()].ggml_type},
             f"{a}/{b}") for a, b, h, i in PACKED_MOE]

