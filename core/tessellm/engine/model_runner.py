"""ModelRunner: turns a SchedulerOutput into device inputs, runs the plan, samples.

Blocks are zeroed when first handed out (and the null block at start): attention kernels read
whole blocks through padded block tables and rely on every such slot being finite. A fresh
block whose every slot the step itself writes (a prefill covering it) is not zeroed: each
layer writes the step's K/V before it attends.
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
replays over them.

Static shapes: on a device with `static_shapes` (XLA), every step is padded to a
StaticStepShape (tokens and sequences to their buckets, all rows treated as prefills, padding
tokens outside every sequence with slot -1, padding sequences empty), the blocks it zeroes are
padded to a power of two with the null block, and `precompile` runs each shape once on padding
alone before the first request, so serving compiles nothing new.

Padded logits rows are sampled greedily as dummy rows and dropped after the readback.

Constrained rows (tessellm.constraints): `launch` starts their token masks (StepMasks, a
worker thread) after the inputs are built and before the plan is run, and the sampler waits
for them only when it needs them; the masks go up like the sampler's other small tables.

Overlap (async scheduling, `overlap=True`): `launch` enqueues a step and returns at once (a
LaunchedStep: the sampled ids stay on the device, their copy to the host is enqueued);
`collect` waits for that copy. The engine launches step N+1 before it collects step N, so a
decode row of N+1 whose token is still pending (sampled by N, not read back) takes its input
id from N's device tensor: the staged id is a placeholder and, after the upload and before
the plan, the compute stream overwrites those rows with N's ids (`index_copy_`). Host staging
buffers and the readback buffer come in two sets used by alternate launches: a set is written
again only after the step that used it was collected.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from tessellm.cache.kv_manager import KVCacheManager
from tessellm.device import DecodeGraphShape, DevicePlugin, Event, StaticShapes, StaticStepShape
from tessellm.engine.block_table_rows import BlockTableRows
from tessellm.engine.step_inputs import (LaunchedStep, StepInputs, StepPadding, bucket_at_least,
                                         blocks_written_in_full, build_step_inputs)
from tessellm.engine.kv_swap import KVSwapper
from tessellm.engine.stage_times import StageTimes
from tessellm.constraints.step_masks import PendingMasks, StepMasks
from tessellm.engine.sampler import (SAMPLE_ROWS, SAMPLE_TABLE, SampleRequest, Sampler,
                                     SelectBitmaskKernel, SelectGreedyKernel, SelectSampleKernel,
                                     TokenLogprobs, TokenMasks, prompt_logprobs_of)
from tessellm.graph.plan import ExecutionPlan
from tessellm.kernels.attention_metadata import AttentionMetadata
from tessellm.parallel.group import ControlChannel
from tessellm.parallel.messages import Batch, BlockOps
from tessellm.request import Request
from tessellm.sampling_params import SamplingParams
from tessellm.scheduler import SchedulerOutput

TOKEN_BITMASK = "token_bitmask"   # staging buffer of the constrained rows' masks
# what the sampler gets for a padded logits row (a static shape or a decode graph's padding):
# greedy, so it costs one argmax and changes nothing; its token is dropped
PADDING_ROW = SampleRequest(SamplingParams(temperature=0.0), 0, (), ())


class ModelRunner:
    def __init__(self, device: DevicePlugin, plan: ExecutionPlan, kv_caches: list[torch.Tensor],
                 block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                 max_blocks_per_seq: int,
                 host_kv_caches: list[torch.Tensor] | None = None,
                 graph_sizes: Sequence[int] = (),
                 select_sample_kernel: SelectSampleKernel | None = None,
                 select_greedy_kernel: SelectGreedyKernel | None = None,
                 static_shapes: StaticShapes | None = None,
                 followers: ControlChannel | None = None, overlap: bool = False,
                 token_masks: StepMasks | None = None,
                 select_bitmask_kernel: SelectBitmaskKernel | None = None) -> None:
        self.device = device
        self.followers = followers   # tensor parallelism: the leader's channel to the others
        self.plan = plan
        self.kv_caches = kv_caches
        self.block_size = block_size
        # Random rows' small host tables go up through the staging buffers (pinned, the
        # transfer stream) on accelerators and when steps overlap; a pageable copy on CUDA
        # would wait for every queued kernel. Not on static-shape devices (a compiled slice
        # per row count) nor on the plain CPU path (nothing to copy there).
        self._stages = (overlap or device.torch_device_type != "cpu") and static_shapes is None
        self.sampler = Sampler(select_sample_kernel,
                               self._stage_small if self._stages else None,
                               select_greedy_kernel, select_bitmask_kernel)
        self.token_masks = token_masks   # None: no request of this engine is constrained
        self.stage_times = StageTimes()
        self.stream = device.new_stream()
        self.swapper = KVSwapper(device, kv_caches, host_kv_caches or [])
        alloc, host = device.allocator(), device.host_allocator()
        T, B, W = max_num_batched_tokens, max_num_seqs, max_blocks_per_seq
        shapes = {"input_ids": ((T,), torch.int64), "positions": ((T,), torch.int64),
                  "slot_mapping": ((T,), torch.int64), "block_tables": ((B, W), torch.int32),
                  "seq_lens": ((B,), torch.int32), "query_start_loc": ((B + 1,), torch.int32),
                  "logits_indices": ((B + T,), torch.int64)}   # + prompt logprobs' rows
        if overlap:
            shapes.update(feed_rows=((B,), torch.int64), feed_src=((B,), torch.int64))
        # fresh blocks to zero in one step: at most T / block_size + 2 per sequence (+ null)
        self._max_fresh = T // block_size + 2 * B + 1
        shapes.update({SAMPLE_ROWS: ((B,), torch.int64), SAMPLE_TABLE: ((4 * B,), torch.float32),
                       "fresh_blocks": ((self._max_fresh,), torch.int64)})
        if token_masks is not None and self._stages:
            shapes[TOKEN_BITMASK] = ((B * token_masks.words,), torch.int32)
        self.overlap = overlap
        self._host_sets = [{k: host.allocate(shape, dt) for k, (shape, dt) in shapes.items()}
                           for _ in range(2 if overlap else 1)]
        self._sampled_sets = [host.allocate((B,), torch.int64) for _ in self._host_sets]
        self._launches = 0
        self.host_bufs, self.host_sampled = self._host_sets[0], self._sampled_sets[0]
        self.dev_bufs = {k: alloc.allocate(shape, dt, tag="input_buffers")
                         for k, (shape, dt) in shapes.items()}
        self.table_rows = BlockTableRows(W, B)
        self.graph_sizes = sorted(g for g in graph_sizes if 1 <= g <= B)
        self.static_shapes = static_shapes
        self._compiled: dict[object, object] = {}
        self.host_syncs = 0   # times the host blocked on the device (one per sampling step)
        self._zero_blocks([KVCacheManager.NULL_BLOCK])

    def _zero_blocks(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        if self.static_shapes is not None:   # a power-of-two count: few shapes to compile
            block_ids = block_ids + [KVCacheManager.NULL_BLOCK] * (
                (1 << (len(block_ids) - 1).bit_length()) - len(block_ids))
        if self._stages and len(block_ids) <= self._max_fresh:
            idx = self._stage_small("fresh_blocks", torch.tensor(block_ids, dtype=torch.int64))
        else:
            idx = torch.tensor(block_ids, dtype=torch.int64).to(self.kv_caches[0].device)
        for cache in self.kv_caches:
            cache.index_fill_(1, idx, 0)
        if self.static_shapes is not None:   # its own graph, not merged into the step's
            self.device.synchronize()

    def wait(self, event: Event) -> None:
        """Block the host until a transfer has landed (counted)."""
        self.host_syncs += 1
        event.wait()

    def apply_block_ops(self, out: SchedulerOutput, kv: KVCacheManager) -> Event | None:
        """The step's block work before inputs are built (on every rank): swap-outs, zeroing
        of fresh blocks (after the swap-outs reading them), copy-on-write, swap-ins. Returns
        the swap-in event compute must be ordered after (None when none)."""
        fresh = kv.take_fresh_blocks()
        return self._lead_block_ops(BlockOps(list(out.swap_out), fresh, list(out.block_copies),
                                             list(out.swap_in),
                                             blocks_written_in_full(out, kv, fresh)))

    def _lead_block_ops(self, ops: BlockOps) -> Event | None:
        if self.followers is not None and not ops.empty:
            self.followers.send(ops)
        return self.run_block_ops(ops)

    def run_block_ops(self, ops: BlockOps) -> Event | None:
        self.swapper.swap_out(ops.swap_out)
        self.swapper.before_reuse(ops.fresh)
        written = set(ops.written_in_full)
        self._zero_blocks([b for b in ops.fresh if b not in written])
        self.swapper.copy_blocks(ops.copies)
        return self.swapper.swap_in(ops.swap_in)

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

    def _stage_small(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """Small host values (the sampler's tables, the blocks to zero) on the device through
        this launch's staging set: pinned memory and the transfer stream; the compute stream
        waits for the copy, the host does not (a pageable copy on CUDA would wait for every
        queued kernel)."""
        views, _ = self._upload({name: values.reshape(-1)})
        return views[name].view(values.shape)

    def _padding(self, s: StepInputs) -> StepPadding | None:
        """How this step is padded: to a decode graph's size, to a static shape, or not at all
        (None: the step runs at its own size)."""
        n = len(s.query_lens)
        if self.static_shapes is not None:
            shapes = self.static_shapes
            seqs = bucket_at_least(shapes.seq_buckets, max(n, len(s.logits_indices)))
            tokens = bucket_at_least(shapes.token_buckets, max(len(s.token_ids), seqs or 0))
            if seqs is None or tokens is None:
                raise ValueError(f"a step of {len(s.token_ids)} tokens and {n} sequences is "
                                 f"beyond the device's static shapes {shapes}")
            return self._step_padding(tokens, seqs, False)
        if not self.graph_sizes or s.num_decodes != n or n > self.graph_sizes[-1] \
                or len(s.logits_indices) != n:   # forks sample one row twice: eager
            return None
        size = bucket_at_least(self.graph_sizes, n)
        return self._step_padding(size, size, True)

    def _step_padding(self, num_tokens: int, num_seqs: int, decode: bool) -> StepPadding:
        W = self.table_rows.width
        key = DecodeGraphShape(num_seqs, W) if decode else StaticStepShape(num_tokens, num_seqs, W)
        return StepPadding(num_tokens, num_seqs, decode, key)

    def _plan_for(self, pad: StepPadding | None):
        if pad is None:
            return self.plan
        compiled = self._compiled.get(pad.key)
        if compiled is None:
            compiled = self.device.compile(self.plan, pad.key)
            self._compiled[pad.key] = compiled
        return compiled

    def _forward(self, s: StepInputs, request_ids: list[str], pad: StepPadding | None,
                 swapped_in: Event | None, previous: LaunchedStep | None = None
                 ) -> tuple[torch.Tensor, Event]:
        """Stage the step's inputs (padded as `pad` says), send them to the tensor-parallel
        followers, run the plan; returns the logits (enqueued) and the upload event.
        Pending input tokens are fed from `previous` (the step in flight)."""
        batch = self._stage(s, request_ids, pad)
        if self.followers is not None:
            tables = self.host_bufs["block_tables"].numpy()[:batch.rows, :batch.width]
            self.followers.send(msgspec.structs.replace(batch, tables=tables.tobytes()))
        feed = None
        if s.pending_rows:
            if previous is None or previous.token_ids is None:
                raise RuntimeError("a step has pending input tokens but no step in flight")
            src = [previous.rows[r.request_id] for r in s.pending]
            feed = (s.pending_rows, src, previous.token_ids)
        return self.run_batch(batch, swapped_in, feed)

    def _stage(self, s: StepInputs, request_ids: list[str], pad: StepPadding | None) -> Batch:
        """The host side of a forward pass: padded rows, and the block table filled into its
        host buffer."""
        n = len(s.query_lens)
        tables_np = self.host_bufs["block_tables"].numpy()
        ids, pos, slots = s.token_ids, s.positions, s.slot_mapping
        seq_lens, query_lens = s.seq_lens, s.query_lens
        logits_idx = s.all_logits_indices or [0]
        num_decodes = s.num_decodes
        if pad is None:
            width = self.table_rows.fill(tables_np, request_ids, s.block_tables)
            rows = n
        else:
            width = self.table_rows.fill(tables_np, request_ids, s.block_tables,
                                         width=self.table_rows.width)
            tables_np[n:pad.num_seqs] = 0
            rows = pad.num_seqs
            extra_tokens, extra_seqs = pad.num_tokens - len(ids), pad.num_seqs - n
            ids, pos = ids + [0] * extra_tokens, pos + [0] * extra_tokens
            slots = slots + [-1] * extra_tokens
            if pad.decode:   # padding decodes: one token each over the null block
                seq_lens, query_lens = seq_lens + [1] * extra_seqs, query_lens + [1] * extra_seqs
                num_decodes = pad.num_seqs
            else:            # padding rows outside every sequence, empty padding sequences
                seq_lens, query_lens = seq_lens + [0] * extra_seqs, query_lens + [0] * extra_seqs
                num_decodes = 0
            logits_idx = s.logits_indices + [0] * (pad.num_seqs - len(s.logits_indices))
        return Batch(ids, pos, slots, seq_lens, query_lens, logits_idx, num_decodes, rows,
                     width, None if pad is None else (pad.num_tokens, pad.num_seqs, pad.decode))

    def run_batch(self, b: Batch, swapped_in: Event | None,
                  feed: tuple[list[int], list[int], torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, Event]:
        """The device side of a forward pass (every rank runs it): upload, then the plan or
        its compiled form. `b.tables`, when given, is the block table (a follower's).
        `feed` = (token rows, rows of the source, source ids on the device): those input
        ids are overwritten on the device after the upload (pending tokens)."""
        if b.tables:
            table = np.frombuffer(b.tables, dtype=np.int32).reshape(b.rows, b.width)
            self.host_bufs["block_tables"].numpy()[:b.rows, :b.width] = table
        qsl = [0]
        for q in b.query_lens:
            qsl.append(qsl[-1] + q)
        values = {
            "input_ids": b.token_ids, "positions": b.positions, "slot_mapping": b.slot_mapping,
            "block_tables": (b.rows, b.width), "seq_lens": b.seq_lens, "query_start_loc": qsl,
            "logits_indices": b.logits_indices}
        if feed is not None:
            values.update(feed_rows=feed[0], feed_src=feed[1])
        dev, uploaded = self._upload(values)
        if feed is not None:   # compute stream, after the upload: the pending ids
            ids = self.dev_bufs["input_ids"]
            ids.index_copy_(0, dev["feed_rows"], feed[2].index_select(0, dev["feed_src"]))
        meta = AttentionMetadata(
            num_decodes=b.num_decodes, num_prefills=len(b.query_lens) - b.num_decodes,
            num_decode_tokens=b.num_decodes, num_prefill_tokens=len(b.token_ids) - b.num_decodes,
            block_size=self.block_size, slot_mapping=dev["slot_mapping"],
            block_tables=dev["block_tables"], seq_lens=dev["seq_lens"],
            query_start_loc=dev["query_start_loc"], seq_lens_host=b.seq_lens,
            query_lens_host=b.query_lens, max_seq_len=max(b.seq_lens),
            max_query_len=max(b.query_lens))
        feeds = {"input_ids": dev["input_ids"], "positions": dev["positions"], "attn_meta": meta,
                 "logits_indices": dev["logits_indices"]}
        feeds.update({f"kv_cache_{i}": c for i, c in enumerate(self.kv_caches)})
        if swapped_in is not None:
            self.swapper.wait_for_compute(swapped_in)
        pad = None if b.pad is None else self._step_padding(*b.pad)
        logits = self._plan_for(pad).run(feeds)   # asynchronous device: enqueued only
        return logits, uploaded

    def _sample(self, logits: torch.Tensor, sampled: list[Request],
                 pending_masks: PendingMasks | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, Event, list[TokenLogprobs | None]]:
        """Sample the real rows (padded logits rows go through as greedy dummies) and enqueue
        the ids' copy to the host; returns (device ids, host ids, their event, logprobs).
        A row's output position counts its pending tokens (the seed position)."""
        rows = [SampleRequest(r.params, len(r.output_token_ids) + r.num_pending,
                              r.prompt_token_ids, r.output_token_ids) for r in sampled]
        rows += [PADDING_ROW] * (logits.shape[0] - len(rows))
        masks = None
        if pending_masks is not None:
            host = pending_masks.wait()
            bitmask = (self._stage_small(TOKEN_BITMASK, host) if self._stages
                       else host.to(logits.device))
            masks = TokenMasks(pending_masks.rows, bitmask)
        result = self.sampler(logits, rows, masks)
        host = self.host_sampled[:logits.shape[0]]
        return (result.token_ids, host, self.stream.copy(host, result.token_ids),
                result.logprobs[:len(sampled)])

    def _padding_shapes(self) -> list[StepPadding]:
        if self.static_shapes is not None:
            return [self._step_padding(t, b, False) for t, b in self.static_shapes.shapes()]
        return [self._step_padding(g, g, True) for g in reversed(self.graph_sizes)]

    def precompile(self) -> int:
        """Run every padded shape the device declares (decode graphs, largest first, or static
        shapes) once on padding rows only, sampling included, and on a static-shape device the
        zeroing of each power-of-two block count, before any request; returns how many step
        shapes ran."""
        shapes = self._padding_shapes()
        for pad in shapes:
            empty = StepInputs()
            logits, _ = self._forward(empty, [], pad, None)
            self.wait(self._sample(logits, [])[2])
            self.device.synchronize()
        if self.static_shapes is not None:
            most = self.static_shapes.token_buckets[-1] // self.block_size \
                + self.static_shapes.seq_buckets[-1] + 1
            count = 1
            while count < 2 * most:
                self._lead_block_ops(BlockOps([], [KVCacheManager.NULL_BLOCK] * count, [], []))
                count *= 2
        return len(shapes)

    def launch(self, out: SchedulerOutput, kv: KVCacheManager,
               previous: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueue one step: block ops, inputs, the plan, sampling and the copy of the ids to
        the host. `previous` is the step still in flight (its pending tokens are inputs)."""
        t0 = time.perf_counter()
        if self.overlap:   # alternate staging sets (see the module docstring)
            self._launches += 1
            k = self._launches % 2
            self.host_bufs, self.host_sampled = self._host_sets[k], self._sampled_sets[k]
        swapped_in = self.apply_block_ops(out, kv)
        s = build_step_inputs(out, kv)
        masks = self.token_masks.start(s.sampled) if self.token_masks is not None else None
        t1 = time.perf_counter()
        logits, uploaded = self._forward(
            s, [sched.request.request_id for sched in out.scheduled], self._padding(s),
            swapped_in, previous)
        t2 = time.perf_counter()
        self.stage_times.add("prepare_inputs", t1 - t0)
        self.stage_times.add("execute", t2 - t1)
        prompt_lps = {}
        if s.prompt_rows:   # the prompt logprobs' rows follow the sampled ones
            prompt_lps = prompt_logprobs_of(logits[len(s.logits_indices):], s.prompt_spans)
            logits = logits[:len(s.logits_indices)]
        if not s.sampled:  # no readback: collect waits for the upload (staging free again)
            return LaunchedStep(out, [], [], None, None, uploaded, {}, prompt_lps)
        token_ids, host, readback, logprobs = self._sample(logits, s.sampled, masks)
        self.stage_times.add("sample", time.perf_counter() - t2)
        return LaunchedStep(out, s.sampled, logprobs, token_ids, host, readback,
                            {r.request_id: i for i, r in enumerate(s.sampled)}, prompt_lps)

    def collect(self, step: LaunchedStep) -> list[int]:
        """Wait for a launched step's ids (the step's one host sync); its sampled requests'
        new token ids, in order."""
        t0 = time.perf_counter()
        self.wait(step.readback)
        self.stage_times.add("sample", time.perf_counter() - t0)
        return [] if step.host is None else step.host.tolist()[:len(step.sampled)]
