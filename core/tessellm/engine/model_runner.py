"""ModelRunner: turns a SchedulerOutput into device inputs, runs the plan, samples.

Blocks are zeroed when first handed out (and the null block at start): attention kernels read
whole blocks through padded block tables and rely on every such slot being finite.
Block copies come first in a step (tessellm.engine.kv_swap): swap-outs are enqueued, the ones
reading blocks about to be reused are waited on, fresh blocks are zeroed, copy-on-write and
swap-in copies follow, and compute is ordered after the swap-ins.
Inputs are staged in host buffers (from the device's host allocator), copied to persistent
device buffers (from the device allocator) through a transfer stream, and compute is ordered
after the copy event with the device's `wait_on_compute` (a stream wait on CUDA: the host goes
on). The one host/device synchronization of a step is reading back the sampled token ids
(counted in `host_syncs`); the previous step's staging buffers are therefore free again when
the next step writes them. Row order follows
the scheduler: decodes first, then prefills, as AttentionMetadata requires.

Decode graphs: on a device with `decode_graph_sizes` (CUDA), a step whose rows are all decodes
(one sampled token each) is padded up to the next captured size and run through
`device.compile(plan, DecodeGraphShape(size, max_blocks_per_seq))`: padding rows have slot -1
(nothing written), seq_len 1 and a table of block 0, block tables always have every column,
and the inputs are the same persistent device buffers on every step, so a captured graph
replays over them. Their logits rows past the real ones are dropped before sampling.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tessellm.cache.kv_manager import KVCacheManager
from tessellm.device import DecodeGraphShape, DevicePlugin, Event
from tessellm.engine.kv_swap import KVSwapper
from tessellm.engine.stage_times import StageTimes
from tessellm.engine.sampler import Sampler, SampleRequest, TokenLogprobs
from tessellm.graph.plan import ExecutionPlan
from tessellm.kernels.attention_metadata import AttentionMetadata
from tessellm.request import Request
from tessellm.scheduler import SchedulerOutput


@dataclass(slots=True)
class StepInputs:
    """Host-side description of one step (lists; converted to tensors once)."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[Sequence[int]]   # read-only views (KVCacheManager.block_table_view)
    seq_lens: list[int]
    query_lens: list[int]
    logits_indices: list[int]
    sampled: list[Request]
    num_decodes: int


def build_step_inputs(out: SchedulerOutput, kv: KVCacheManager) -> StepInputs:
    """One row per scheduled request; a logits index (and sampled request) per request that
    completes in this step, followed by one per sibling forking from it (out.forks): they
    sample from its row, each with its own SamplingParams and seed."""
    s = StepInputs([], [], [], [], [], [], [], [], 0)
    for sched in out.scheduled:
        r, n = sched.request, sched.num_tokens
        start, stop = r.num_computed_tokens, r.num_computed_tokens + n
        s.token_ids += r.token_ids_slice(start, stop)
        s.positions += range(start, stop)
        s.slot_mapping += kv.slot_mapping(r, start, stop)
        s.block_tables.append(kv.block_table_view(r.request_id))
        s.seq_lens.append(stop)
        s.query_lens.append(n)
        if stop == r.num_tokens:  # fully computed after this step: sample its next token
            s.logits_indices.append(len(s.token_ids) - 1)
            s.sampled.append(r)
            for child in out.forks.get(r.request_id, ()):   # n > 1: the same row again
                s.logits_indices.append(len(s.token_ids) - 1)
                s.sampled.append(child)
    while s.num_decodes < len(s.query_lens) and s.query_lens[s.num_decodes] == 1:
        s.num_decodes += 1
    return s


class BlockTableRows:
    """Each request's block table as a persistent int32 row, updated incrementally: a row is
    rebuilt only when the KV manager gave the request a new table list (copy-on-write,
    reallocation), else only the appended tail is copied. Filling a step's [B, width] table
    is then one memcpy per request, whatever the context length."""

    def __init__(self, max_blocks_per_seq: int, max_rows: int) -> None:
        self.width = max_blocks_per_seq
        self.max_rows = max_rows
        self._rows: dict[str, tuple[Sequence[int], np.ndarray, int]] = {}

    def row(self, request_id: str, table: Sequence[int]) -> np.ndarray:
        known = self._rows.get(request_id)
        if known is not None and known[0] is table:
            _, row, synced = known
            if len(table) > synced:
                row[synced:len(table)] = table[synced:]
        else:
            row = np.zeros(self.width, dtype=np.int32)
            row[:len(table)] = table
        self._rows[request_id] = (table, row, len(table))
        return row

    def fill(self, out: np.ndarray, request_ids: list[str],
             tables: list[Sequence[int]], width: int | None = None) -> int:
        """Write the rows of this step's requests into out[:len, :width] (width: the longest
        table unless given; columns past a table are 0); returns width."""
        width = width or max(1, max((len(t) for t in tables), default=1))
        for i, (rid, table) in enumerate(zip(request_ids, tables)):
            out[i, :width] = self.row(rid, table)[:width]
        if len(self._rows) > 2 * self.max_rows:   # forget requests that left
            keep = set(request_ids)
            self._rows = {k: v for k, v in self._rows.items() if k in keep}
        return width


class ModelRunner:
    def __init__(self, device: DevicePlugin, plan: ExecutionPlan, kv_caches: list[torch.Tensor],
                 block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                 max_blocks_per_seq: int,
                 host_kv_caches: list[torch.Tensor] | None = None,
                 graph_sizes: Sequence[int] = ()) -> None:
        self.device = device
        self.plan = plan
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = Sampler()
        self.stage_times = StageTimes()
        self.stream = device.new_stream()
        self.swapper = KVSwapper(device, kv_caches, host_kv_caches or [])
        alloc, host = device.allocator(), device.host_allocator()
        T, B, W = max_num_batched_tokens, max_num_seqs, max_blocks_per_seq
        shapes = {"input_ids": ((T,), torch.int64), "positions": ((T,), torch.int64),
                  "slot_mapping": ((T,), torch.int64), "block_tables": ((B, W), torch.int32),
                  "seq_lens": ((B,), torch.int32), "query_start_loc": ((B + 1,), torch.int32),
                  "logits_indices": ((B,), torch.int64)}
        self.host_bufs = {k: host.allocate(shape, dt) for k, (shape, dt) in shapes.items()}
        self.dev_bufs = {k: alloc.allocate(shape, dt, tag="input_buffers")
                         for k, (shape, dt) in shapes.items()}
        self.host_sampled = host.allocate((B,), torch.int64)
        self.table_rows = BlockTableRows(W, B)
        self.graph_sizes = sorted(g for g in graph_sizes if 1 <= g <= B)
        self._graphs: dict[int, object] = {}
        self.host_syncs = 0   # times the host blocked on the device (one per sampling step)
        self._zero_blocks([KVCacheManager.NULL_BLOCK])

    def _zero_blocks(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.int64).to(self.kv_caches[0].device)
        for cache in self.kv_caches:
            cache.index_fill_(1, idx, 0)

    def wait(self, event: Event) -> None:
        """Block the host until a transfer has landed (counted)."""
        self.host_syncs += 1
        event.wait()

    def apply_block_ops(self, out: SchedulerOutput, kv: KVCacheManager) -> Event | None:
        """The step's block work before inputs are built: swap-outs, zeroing of fresh blocks
        (after the swap-outs reading them), copy-on-write, swap-ins. Returns the swap-in
        event compute must be ordered after (None when none)."""
        self.swapper.swap_out(out.swap_out)
        fresh = kv.take_fresh_blocks()
        self.swapper.before_reuse(fresh)
        self._zero_blocks(fresh)
        self.swapper.copy_blocks(out.block_copies)
        return self.swapper.swap_in(out.swap_in)

    def _upload(self, values: dict[str, list | tuple[int, int]]
                ) -> tuple[dict[str, torch.Tensor], Event]:
        """Stage host values, enqueue their copies and order compute after them; returns
        device views. A (rows, cols) tuple names a 2-D buffer already filled on the host."""
        views = {}
        for name, vals in values.items():
            if isinstance(vals, tuple):
                h = self.host_bufs[name][:vals[0], :vals[1]]
                d = self.dev_bufs[name][:vals[0], :vals[1]]
            else:
                src = torch.as_tensor(vals, dtype=self.host_bufs[name].dtype)
                h, d = self.host_bufs[name][:src.shape[0]], self.dev_bufs[name][:src.shape[0]]
                h.copy_(src)
            self.stream.copy(d, h)
            views[name] = d
        landed = self.stream.record_event()
        self.device.wait_on_compute(landed)
        return views, landed

    def _graph_size(self, s: StepInputs) -> int | None:
        """The captured size a pure-decode step is padded to; None: run it eagerly."""
        n = len(s.query_lens)
        if not self.graph_sizes or s.num_decodes != n or n > self.graph_sizes[-1] \
                or len(s.logits_indices) != n:   # forks sample one row twice: eager
            return None
        return self.graph_sizes[bisect.bisect_left(self.graph_sizes, n)]

    def _plan_for(self, graph_size: int | None):
        if graph_size is None:
            return self.plan
        compiled = self._graphs.get(graph_size)
        if compiled is None:
            compiled = self.device.compile(
                self.plan, DecodeGraphShape(graph_size, self.table_rows.width))
            self._graphs[graph_size] = compiled
        return compiled

    def _forward(self, s: StepInputs, request_ids: list[str], graph_size: int | None,
                 swapped_in: Event | None) -> tuple[torch.Tensor, Event]:
        """Stage and upload the step's inputs (padded to `graph_size` when given), run the plan
        or its graph; returns the logits of the real rows (enqueued) and the upload event."""
        n = len(s.query_lens)
        tables_np = self.host_bufs["block_tables"].numpy()
        if graph_size is None:
            width = self.table_rows.fill(tables_np, request_ids, s.block_tables)
            rows = n
            ids, pos, slots = s.token_ids, s.positions, s.slot_mapping
            seq_lens, query_lens, logits_idx = s.seq_lens, s.query_lens, s.logits_indices or [0]
            num_decodes = s.num_decodes
        else:
            pad = graph_size - n
            width = self.table_rows.fill(tables_np, request_ids, s.block_tables,
                                         width=self.table_rows.width)
            tables_np[n:graph_size] = 0
            rows = graph_size
            ids, pos = s.token_ids + [0] * pad, s.positions + [0] * pad
            slots = s.slot_mapping + [-1] * pad
            seq_lens, query_lens = s.seq_lens + [1] * pad, s.query_lens + [1] * pad
            logits_idx = list(range(graph_size))
            num_decodes = graph_size
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        dev, uploaded = self._upload({
            "input_ids": ids, "positions": pos, "slot_mapping": slots,
            "block_tables": (rows, width), "seq_lens": seq_lens, "query_start_loc": qsl,
            "logits_indices": logits_idx})
        meta = AttentionMetadata(
            num_decodes=num_decodes, num_prefills=len(query_lens) - num_decodes,
            num_decode_tokens=num_decodes, num_prefill_tokens=len(ids) - num_decodes,
            block_size=self.block_size, slot_mapping=dev["slot_mapping"],
            block_tables=dev["block_tables"], seq_lens=dev["seq_lens"],
            query_start_loc=dev["query_start_loc"], seq_lens_host=seq_lens,
            query_lens_host=query_lens, max_seq_len=max(seq_lens),
            max_query_len=max(query_lens))
        feeds = {"input_ids": dev["input_ids"], "positions": dev["positions"], "attn_meta": meta,
                 "logits_indices": dev["logits_indices"]}
        feeds.update({f"kv_cache_{i}": c for i, c in enumerate(self.kv_caches)})
        if swapped_in is not None:
            self.swapper.wait_for_compute(swapped_in)
        logits = self._plan_for(graph_size).run(feeds)   # asynchronous device: enqueued only
        return (logits if graph_size is None else logits[:n]), uploaded

    def capture_decode_graphs(self) -> int:
        """Run (and so capture) every decode graph size once on padding rows only, largest
        first, before any request; returns how many sizes there are."""
        for size in reversed(self.graph_sizes):
            empty = StepInputs([], [], [], [], [], [], [], [], 0)
            _, uploaded = self._forward(empty, [], size, None)
            self.device.synchronize()
            self.wait(uploaded)
        return len(self.graph_sizes)

    def execute(
        self, out: SchedulerOutput, kv: KVCacheManager
    ) -> tuple[list[Request], list[int], list[TokenLogprobs | None]]:
        """Run one step; returns the requests that sampled, their new token ids and, per
        request, the token's logprobs (None where its params.logprobs is None)."""
        t0 = time.perf_counter()
        swapped_in = self.apply_block_ops(out, kv)
        s = build_step_inputs(out, kv)
        t1 = time.perf_counter()
        logits, uploaded = self._forward(
            s, [sched.request.request_id for sched in out.scheduled], self._graph_size(s),
            swapped_in)
        t2 = time.perf_counter()
        self.stage_times.add("prepare_inputs", t1 - t0)
        self.stage_times.add("execute", t2 - t1)
        if not s.sampled:  # no readback this step: free the staging buffers explicitly
            self.wait(uploaded)
            return [], [], []
        result = self.sampler(logits, [
            SampleRequest(r.params, len(r.output_token_ids), r.prompt_token_ids,
                          r.output_token_ids) for r in s.sampled])
        host = self.host_sampled[:len(s.sampled)]
        self.wait(self.stream.copy(host, result.token_ids))
        self.stage_times.add("sample", time.perf_counter() - t2)
        return s.sampled, host.tolist(), result.logprobs
