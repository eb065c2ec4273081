"""Graph passes (ModelGraph -> ModelGraph) and the pass manager.

A fusion pass declares the device ops it introduces (`requires`); the manager runs it only when
the active device has a kernel for every one of them, so a graph never holds an op the device
cannot run. Order matters: gate/up fusion must precede silu_and_mul (which matches the halves
of the fused gate/up output); dead-code removal runs last and drops unread weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tessellm.graph.ir import ModelGraph


@dataclass(frozen=True, slots=True)
class GraphPass:
    name: str
    run: Callable[[ModelGraph], ModelGraph]
    requires: tuple[str, ...] = ()


@dataclass(slots=True)
class PassReport:
    applied: list[str]
    skipped: dict[str, str]


def run_passes(mg: ModelGraph, passes: list[GraphPass],
               has_kernel: Callable[[str], bool]) -> tuple[ModelGraph, PassReport]:
    report = PassReport(applied=[], skipped={})
    for p in passes:
        missing = [op for op in p.requires if not has_kernel(op)]
        if missing:
            report.skipped[p.name] = f"device has no kernel for {', '.join(missing)}"
            continue
        mg = p.run(mg)
        mg.graph.lint()
        report.applied.append(p.name)
    return mg, report


def default_passes() -> list[GraphPass]:
    from tessellm.graph.passes.dead_code import remove_dead_code
    from tessellm.graph.passes.fuse_add_rms_norm import fuse_add_rms_norm
    from tessellm.graph.passes.fuse_linears import fuse_gate_up, fuse_qkv
    from tessellm.graph.passes.fuse_silu_and_mul import fuse_silu_and_mul
    return [
        GraphPass("fuse_qkv", fuse_qkv, ("linear",)),
        GraphPass("fuse_gate_up", fuse_gate_up, ("linear",)),
        GraphPass("fuse_silu_and_mul", fuse_silu_and_mul, ("silu_and_mul",)),
        GraphPass("fuse_add_rms_norm", fuse_add_rms_norm, ("fused_add_rms_norm",)),
        GraphPass("remove_dead_code", remove_dead_code),
    ]
