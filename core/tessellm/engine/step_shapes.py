"""StepShapes: the shape a step runs at, and the plan for it.

A step runs at its own size (the eager plan) unless the device pads it: to a captured decode
graph's size (`decode_graph_sizes`, CUDA: every row a decode with one sampled token; padding
rows have slot -1, seq_len 1 and a table of block 0) or to a static shape (`static_shapes`,
XLA: tokens and sequences to their buckets, all rows prefills, padding tokens outside every
sequence). Padded steps have block tables of every column. The device compiles the plan once
per padded shape (`device.compile(plan, key)`), kept here.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessellm.device import DecodeGraphShape, DevicePlugin, StaticShapes, StaticStepShape
from tessellm.engine.step_inputs import StepInputs, StepPadding, bucket_at_least
from tessellm.graph.plan import ExecutionPlan


class StepShapes:
    def __init__(self, device: DevicePlugin, plan: ExecutionPlan, table_width: int,
                 graph_sizes: Sequence[int] = (), static_shapes: StaticShapes | None = None
                 ) -> None:
        self.device, self.plan, self.table_width = device, plan, table_width
        self.graph_sizes = list(graph_sizes)
        self.static_shapes = static_shapes
        self._compiled: dict[object, Any] = {}
        self._profile_sink: Any = None

    def padding(self, s: StepInputs) -> StepPadding | None:
        """How step `s` is padded (None: it runs at its own size)."""
        n = len(s.query_lens)
        if self.static_shapes is not None:
            shapes = self.static_shapes
            seqs = bucket_at_least(shapes.seq_buckets, max(n, len(s.logits_indices)))
            tokens = bucket_at_least(shapes.token_buckets, max(len(s.token_ids), seqs or 0))
            if seqs is None or tokens is None:
                raise ValueError(f"a step of {len(s.token_ids)} tokens and {n} sequences is "
                                 f"beyond the device's static shapes {shapes}")
            return self.step_padding(tokens, seqs, False)
        if not self.graph_sizes or s.num_decodes != n or n > self.graph_sizes[-1] \
                or len(s.logits_indices) != n:   # forks sample one row twice: eager
            return None
        size = bucket_at_least(self.graph_sizes, n)
        return self.step_padding(size, size, True)

    def step_padding(self, num_tokens: int, num_seqs: int, decode: bool) -> StepPadding:
        W = self.table_width
        key = DecodeGraphShape(num_seqs, W) if decode else StaticStepShape(num_tokens, num_seqs, W)
        return StepPadding(num_tokens, num_seqs, decode, key)

    def plan_for(self, pad: StepPadding | None) -> Any:
        """The eager plan, or its compiled form for a padded shape (compiled on first use)."""
        if pad is None:
            return self.plan
        compiled = self._compiled.get(pad.key)
        if compiled is None:
            compiled = self.device.compile(self.plan, pad.key)
            if hasattr(compiled, "profile_sink"):
                compiled.profile_sink = self._profile_sink
            self._compiled[pad.key] = compiled
        return compiled

    def set_profile_sink(self, sink: Any) -> None:
        """Hand every compiled plan that reports its time (a `profile_sink` attribute), made
        so far or later, this PlanProfileSink (None: stop)."""
        self._profile_sink = sink
        for compiled in self._compiled.values():
            if hasattr(compiled, "profile_sink"):
                compiled.profile_sink = sink

    def all_paddings(self) -> list[StepPadding]:
        """Every padded shape the device declares (decode graphs largest first)."""
        if self.static_shapes is not None:
            return [self.step_padding(t, b, False) for t, b in self.static_shapes.shapes()]
        return [self.step_padding(g, g, True) for g in reversed(self.graph_sizes)]
