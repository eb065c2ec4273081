"""A CPU device that exercises the engine's decode-graph path (reached by the fake entry point
"graph_device:plugin"): it declares graph sizes and its `compile` returns a stand-in graph that
records what a captured graph relies on. Like a CUDA graph it fixes its inputs at the first
call: a later call whose input tensors live elsewhere fails, so does one whose host-side
metadata the capture would have baked in differs from the capture's in the one thing it may
shape (the number of sequences)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tessellm.plugin_api import DecodeGraphShape, hookimpl
from tessellm_cpu.device import CpuDevice


def pointers(feeds: dict[str, Any]) -> tuple[int, ...]:
    out = []
    for v in feeds.values():
        if hasattr(v, "data_ptr"):
            out.append(v.data_ptr())
        elif hasattr(v, "__slots__"):
            out += [getattr(v, f).data_ptr() for f in v.__slots__
                    if hasattr(getattr(v, f), "data_ptr")]
    return tuple(out)


class RecordingGraph:
    def __init__(self, plan: Any, shape: DecodeGraphShape) -> None:
        self.plan, self.shape = plan, shape
        self.calls = 0
        self._pointers: tuple[int, ...] | None = None

    def run(self, feeds: dict[str, Any]) -> Any:
        meta = feeds["attn_meta"]
        assert meta.num_decodes == self.shape.num_seqs and meta.num_prefills == 0
        assert tuple(meta.block_tables.shape) == (self.shape.num_seqs, self.shape.max_blocks)
        assert feeds["input_ids"].shape[0] == self.shape.num_seqs
        ptrs = pointers(feeds)
        if self._pointers is None:
            self._pointers = ptrs
        assert ptrs == self._pointers, "graph inputs moved since capture"
        self.calls += 1
        return self.plan.run(feeds)


class GraphCpuDevice(CpuDevice):
    name = "cpu-graphs"
    priority = -30

    budget_bytes = 1 << 18   # what its "measurement" leaves for the KV pool, x utilization

    def __init__(self) -> None:
        super().__init__()
        self.graphs: dict[int, RecordingGraph] = {}
        self.profiled = 0

    def kv_cache_budget(self, profile_forward, utilization: float) -> int:
        profile_forward()   # the real profiling pass over the real plan
        self.profiled += 1
        return int(self.budget_bytes * utilization)

    def decode_graph_sizes(self, max_num_seqs: int) -> list[int]:
        return sorted({s for s in (1, 2, 4, 8) if s < max_num_seqs} | {max_num_seqs})

    def compile(self, plan: Any, shape_key: Any) -> Any:
        assert isinstance(shape_key, DecodeGraphShape)
        graph = RecordingGraph(plan, shape_key)
        self.graphs[shape_key.num_seqs] = graph
        return graph

    def kernels(self):
        from tessellm_cpu.kernels import cpu_kernels
        return cpu_kernels(self.name)


plugin = SimpleNamespace(
    TESSELLM_API_VERSION="1.2",
    tessellm_devices=hookimpl(lambda: [GraphCpuDevice()]),
)
