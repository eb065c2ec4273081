"""One device kernel against the reference op over the conformance matrix.

For each case the kernel's `supports` predicate accepts, the reference runs on host copies of
the inputs and the kernel on device copies (its weight first prepared into its own layout, as
the profiler and execution plans do); outputs must have the reference's shape and dtype,
integers must be equal, floats within the profiler's tolerance for the dtype, on the rows the
engine reads. A kernel that accepts no case of the matrix cannot be shown correct and fails.
"""
from __future__ import annotations

from typing import Any

import torch

from tessellm.kernels.attention_metadata import AttentionMetadata
from tessellm.kernels.examples import IN_PLACE_OUTPUT_ARG
from tessellm.kernels.profiler import check_tolerance
from tessellm.kernels.reference import REFERENCE_OPS
from tessellm.kernels.registry import Kernel
from tessellm.quant.formats import PackedWeight
from tessellm.testing.kernel_cases import KernelCase, Padding, attention_metadata_to, kernel_cases

MAX_LISTED_FAILURES = 3


class CheckFailed(Exception):
    """A check's verdict: the message is the detail shown in the report."""


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, PackedWeight):
        return value.with_data(value.data.clone())
    if isinstance(value, AttentionMetadata):
        return attention_metadata_to(value, "cpu")
    return value


def to_device(value: Any, device: str) -> Any:
    """A copy of a host argument on `device` (tensors, packed weights, attention metadata)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, copy=True)
    if isinstance(value, PackedWeight):
        return value.with_data(value.data.to(device, copy=True))
    if isinstance(value, AttentionMetadata):
        return attention_metadata_to(value, device)
    return value


def _outputs(op: str, args: list[Any], result: Any) -> list[torch.Tensor]:
    if op in IN_PLACE_OUTPUT_ARG:
        return [args[IN_PLACE_OUTPUT_ARG[op]]]
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _compare(got: Any, want: torch.Tensor, rows: int | None, dtype: torch.dtype,
             op: str) -> str | None:
    """Why `got` is not the reference output `want` (None when it is)."""
    if not isinstance(got, torch.Tensor):
        return f"returned {type(got).__name__}, not a tensor"
    if tuple(got.shape) != tuple(want.shape):
        return f"output shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"output dtype {got.dtype} != reference {want.dtype}"
    g, w = got.detach().cpu(), want
    if rows is not None:
        g, w = g[:rows], w[:rows]
    if not w.dtype.is_floating_point:
        if not torch.equal(g, w):
            bad = int((g != w).sum())
            return f"{bad} of {w.numel()} integer outputs differ from the reference"
        return None
    rtol, atol = check_tolerance(op, dtype)
    if not torch.allclose(g.float(), w.float(), rtol=rtol, atol=atol):
        diff = (g.float() - w.float()).abs()
        worst = float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0
        return (f"differs from the reference: max abs diff {worst:.3g} "
                f"(rtol {rtol}, atol {atol})")
    return None


def run_case(kernel: Kernel, case: KernelCase, device: str) -> str | None:
    """Why the kernel fails this case, or None when it matches the reference."""
    inputs = case.inputs()
    ref_args = [_clone(a) for a in inputs.args]
    expected = _outputs(kernel.op, ref_args, REFERENCE_OPS[kernel.op](*ref_args))
    args = [to_device(a, device) for a in inputs.args]
    try:
        if kernel.weight_layout is not None:
            args[1] = kernel.weight_layout.prepare(args[1])
        got = _outputs(kernel.op, args, kernel.fn(*args))
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}"
    if len(got) != len(expected):
        return f"{len(got)} outputs, the reference has {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        why = _compare(g, e, inputs.compare_rows, case.query.dtype, kernel.op)
        if why is not None:
            return why if len(expected) == 1 else f"output {i}: {why}"
    return None


def check_kernel(kernel: Kernel, device: str, padding: Padding) -> str:
    """Runs every supported case; returns the pass detail or raises CheckFailed."""
    cases = kernel_cases(kernel.op, padding)
    supported = [c for c in cases if kernel.supports(c.query)]
    if not supported:
        raise CheckFailed(f"its supports() accepts none of the {len(cases)} conformance cases "
                          f"of {kernel.op!r}, so it cannot be checked")
    failures = []
    for case in supported:
        why = run_case(kernel, case, device)
        if why is not None:
            failures.append(f"{case.label}: {why}")
    if failures:
        listed = "\n".join(failures[:MAX_LISTED_FAILURES])
        more = len(failures) - MAX_LISTED_FAILURES
        raise CheckFailed(f"{len(failures)} of {len(supported)} cases differ from the "
                          f"reference:\n{listed}" + (f"\n... and {more} more" if more > 0 else ""))
    skipped = len(cases) - len(supported)
    return f"{len(supported)} cases match the reference" + (
        f" ({skipped} outside its supports())" if skipped else "")
