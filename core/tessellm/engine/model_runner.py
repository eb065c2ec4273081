"""ModelRunner: turns a SchedulerOutput into device inputs, runs the plan, samples.

Its parts, one concept each: BlockWork (a step's KV block work first: swap-outs, fresh blocks
zeroed, copy-on-write, swap-ins; tessellm.engine.block_work), InputStaging (host staging
buffers copied to persistent device buffers through a transfer stream; two alternating sets
when steps overlap; tessellm.engine.input_staging), StepShapes (padding to decode graphs or
static shapes and the compiled plans; tessellm.engine.step_shapes) and the Sampler.

Host syncs: the host blocks on the device where it reads back the sampled ids (`collect`,
counted in `host_syncs`) and where a sampled row needs host values of its logits (logprobs,
penalties' counts: the sampler); the previous step's staging buffers are free again when the
next step writes them. Row order follows the scheduler: decodes first, then prefills, as
AttentionMetadata requires. Padded logits rows (decode graphs, static shapes) are sampled
greedily as dummy rows and dropped after the readback.

Constrained rows (tessellm.constraints): `launch` starts their token masks (StepMasks, a
worker thread) after the inputs are built and before the plan is run, and the sampler waits
for them only when it needs them; the masks go up like the sampler's other small tables.

Overlap (async scheduling, `overlap=True`): `launch` enqueues a step and returns at once (a
LaunchedStep: the sampled ids stay on the device, their copy to the host is enqueued);
`collect` waits for that copy. The engine launches step N+1 before it collects step N, so a
decode row of N+1 whose token is still pending (sampled by N, not read back) takes its input
id from N's device tensor: the staged id is a placeholder and, after the upload and before
the plan, the compute stream overwrites those rows with N's ids (`index_copy_`).

LoRA (a plan with the `lora_slots` input, tessellm.lora.sites): every token row's adapter
slot (-1: base model; padding rows too) is staged and fed like the positions.

Hybrid models (block-table groups, tessellm.cache.kv_groups): each group after the first has
its own slot mapping and block-table buffers and its own AttentionMetadata (the first's
lengths and query offsets, its tables and slots), fed to its layers' attention nodes; layer
i reads KV tensor layout.layer_tensors[i]. Block work is the same for every group (global
block ids over every tensor).

Tensor parallelism: the leader sends each step's BlockOps and its forward rows with the block
table (parallel.messages.Batch) to the other ranks, which replay them (`run_block_ops`,
`run_rows`); a single device never builds those messages. Pipeline parallelism: `run_rows`
splits the step into micro-batches of whole requests (parallel.micro_batches; each gets its
own views of the uploaded inputs and its own AttentionMetadata, `_feeds`) and runs the plan
on each through the rank's StageLink (parallel.pipe): the hidden state comes from the
previous stage and goes on to the next, and the leader gets the logits in the step's order.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from tessellm.cache.kv_groups import KVCache, KVCacheLayout
from tessellm.cache.kv_manager import KVCacheManager
from tessellm.device import DevicePlugin, Event, StaticShapes
from tessellm.engine.block_table_rows import GroupTableRows, group_names
from tessellm.engine.block_work import BlockWork
from tessellm.engine.input_staging import InputStaging
from tessellm.engine.step_inputs import (ForwardRows, LaunchedStep, StepInputs, StepPadding,
                                         blocks_written_in_full, build_step_inputs)
from tessellm.engine.step_shapes import StepShapes
from tessellm.engine.kv_swap import KVSwapper
from tessellm.engine.stage_times import StageTimes
from tessellm.constraints.step_masks import PendingMasks, StepMasks
from tessellm.engine.logprobs_from_logits import prompt_logprobs_of
from tessellm.engine.sampler import (SAMPLE_ROWS, SAMPLE_TABLE, SampleRequest, Sampler,
                                     SelectBitmaskKernel, SelectGreedyKernel, SelectSampleKernel,
                                     TokenLogprobs, TokenMasks)
from tessellm.graph.plan import KV_CACHE_FEED, STEP_FEEDS, ExecutionPlan, group_meta_feeds
from tessellm.kernels.attention_metadata import AttentionMetadata
from tessellm.lora.sites import LORA_SLOTS_FEED
from tessellm.parallel.group import ControlChannel
from tessellm.parallel.messages import Batch, BlockOps
from tessellm.parallel.micro_batches import MicroBatch, split_rows
from tessellm.parallel.pipe import StageLink
from tessellm.request import Request
from tessellm.sampling_params import SamplingParams
from tessellm.scheduler import SchedulerOutput

TOKEN_BITMASK = "token_bitmask"   # staging buffer of the constrained rows' masks
# what the sampler gets for a padded logits row (a static shape or a decode graph's padding):
# greedy, so it costs one argmax and changes nothing; its token is dropped
PADDING_ROW = SampleRequest(SamplingParams(temperature=0.0), 0, (), ())


@dataclass(frozen=True, slots=True)
class RunnerLimits:
    """`max_num_seqs`: rows a step may have, each sampled once (the engine's max_num_seqs;
    with speculation, times 1 + k: a verify entry is a decode row per draft plus one)."""

    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_blocks_per_seq: int


@dataclass(frozen=True, slots=True)
class SamplerKernels:
    """The sampler's kernel choosers (None: the reference op)."""

    sample: SelectSampleKernel | None = None
    greedy: SelectGreedyKernel | None = None
    bitmask: SelectBitmaskKernel | None = None


def _buffer_shapes(limits: RunnerLimits, overlap: bool, token_masks: StepMasks | None,
                   staged_masks: bool, lora: bool, num_groups: int) -> dict:
    T, B, W = limits.max_num_batched_tokens, limits.max_num_seqs, limits.max_blocks_per_seq
    shapes = {"input_ids": ((T,), torch.int64), "positions": ((T,), torch.int64),
              **{name: ((T,), torch.int64) for name in group_names("slot_mapping",
                                                                     num_groups)},
              **{name: ((B, W), torch.int32) for name in group_names("block_tables",
                                                                     num_groups)},
              "seq_lens": ((B,), torch.int32),
              # one more offset per micro-batch (pipeline stages: parallel.micro_batches)
              "query_start_loc": ((2 * B,), torch.int32),
              "logits_indices": ((B + T,), torch.int64),   # + prompt logprobs' rows
              SAMPLE_ROWS: ((B,), torch.int64), SAMPLE_TABLE: ((4 * B,), torch.float32),
              "fresh_blocks": ((max_fresh_blocks(limits),), torch.int64)}
    if overlap:
        shapes.update(feed_rows=((B,), torch.int64), feed_src=((B,), torch.int64))
    if token_masks is not None and staged_masks:
        shapes[TOKEN_BITMASK] = ((B * token_masks.words,), torch.int32)
    if lora:
        shapes[LORA_SLOTS_FEED] = ((T,), torch.int64)
    return shapes


def max_fresh_blocks(limits: RunnerLimits) -> int:
    """Fresh blocks one step can zero: T / block_size + 2 per sequence, and the null block."""
    return limits.max_num_batched_tokens // limits.block_size + 2 * limits.max_num_seqs + 1


class ModelRunner:
    def __init__(self, device: DevicePlugin, plan: ExecutionPlan, kv_caches: list[torch.Tensor],
                 limits: RunnerLimits, *, host_kv_caches: list[torch.Tensor] | None = None,
                 graph_sizes: Sequence[int] = (), static_shapes: StaticShapes | None = None,
                 followers: ControlChannel | None = None, overlap: bool = False,
                 token_masks: StepMasks | None = None,
                 sampler_kernels: SamplerKernels = SamplerKernels(),
                 pipe: StageLink | None = None, layout: KVCacheLayout | None = None) -> None:
        """`kv_caches`: the KV tensors, layer i's at layout.layer_tensors[i] (default: one
        per layer, one block-table group)."""
        self.device = device
        self.pipe = pipe   # pipeline parallelism: this rank's links to its neighbour stages
        self.followers = followers   # tensor parallelism: the leader's channel to the others
        self.kv_caches = kv_caches
        self.layout = layout or KVCacheLayout.of([0] * len(kv_caches))
        groups = self.layout.num_groups
        # the graph's metadata feeds past the first (a hybrid model's groups): each its
        # group's, or the one group's when the pool has one (pipeline parallelism)
        self._group_feeds = [(name, g if groups > 1 else 0)
                             for name, g in group_meta_feeds(plan.inputs)]
        self.block_size = limits.block_size
        self.overlap = overlap
        # Small host tables (the sampler's, the blocks to zero) go up through the staging
        # buffers (pinned, the transfer stream) on accelerators and when steps overlap; a
        # pageable copy on CUDA would wait for every queued kernel. Not on static-shape devices
        # (a compiled slice per row count) nor on the plain CPU path (nothing to copy there).
        self._stages = (overlap or device.torch_device_type != "cpu") and static_shapes is None
        self.lora = LORA_SLOTS_FEED in plan.inputs   # a LoRA engine: each token's slot is fed
        self.staging = InputStaging(device, _buffer_shapes(limits, overlap, token_masks,
                                                           self._stages, self.lora, groups),
                                    readback_rows=limits.max_num_seqs, sets=2 if overlap else 1)
        stage = self.staging.stage_small if self._stages else None
        self.sampler = Sampler(sampler_kernels.sample, stage, sampler_kernels.greedy,
                               sampler_kernels.bitmask)
        self.token_masks = token_masks   # None: no request of this engine is constrained
        self.stage_times = StageTimes()
        self.blocks = BlockWork(
            device, kv_caches, KVSwapper(device, kv_caches, host_kv_caches or []),
            static_shapes is not None, max_fresh_blocks(limits),
            (lambda ids: self.staging.stage_small("fresh_blocks", ids)) if self._stages
            else None)
        self.table_rows = GroupTableRows(limits.max_blocks_per_seq, limits.max_num_seqs,
                                         groups)
        self.shapes = StepShapes(device, plan, limits.max_blocks_per_seq,
                                 sorted(g for g in graph_sizes
                                        if 1 <= g <= limits.max_num_seqs), static_shapes)
        self.host_syncs = 0   # times the host blocked on the device to read sampled ids
        self.blocks.zero([KVCacheManager.NULL_BLOCK])

    @property
    def graph_sizes(self) -> list[int]:
        return self.shapes.graph_sizes

    @property
    def static_shapes(self) -> StaticShapes | None:
        return self.shapes.static_shapes

    def wait(self, event: Event) -> None:
        """Block the host until a transfer has landed (counted)."""
        self.host_syncs += 1
        event.wait()

    def apply_block_ops(self, out: SchedulerOutput, kv: KVCache) -> Event | None:
        """The step's block work before inputs are built (on every rank): swap-outs, zeroing
        of fresh blocks (after the swap-outs reading them), copy-on-write, swap-ins. Returns
        the swap-in event compute must be ordered after (None when none)."""
        fresh = kv.take_fresh_blocks()
        return self._lead_block_ops(BlockOps(list(out.swap_out), fresh, list(out.block_copies),
                                             list(out.swap_in),
                                             blocks_written_in_full(out, kv, fresh)))

    def send_to_followers(self, message: object) -> None:
        """Tensor parallelism: a control message for the other ranks (none: nothing)."""
        if self.followers is not None:
            self.followers.send(message)

    def _lead_block_ops(self, ops: BlockOps) -> Event | None:
        if self.followers is not None and not ops.empty:
            self.followers.send(ops)
        return self.run_block_ops(ops)

    def run_block_ops(self, ops: BlockOps) -> Event | None:
        """A step's block work (a follower replays the leader's)."""
        return self.blocks.run(ops)

    def _forward(self, s: StepInputs, request_ids: list[str], pad: StepPadding | None,
                 swapped_in: Event | None, previous: LaunchedStep | None = None
                 ) -> tuple[torch.Tensor, Event]:
        """Stage the step's inputs (padded as `pad` says), send them to the tensor-parallel
        followers, run the plan; returns the logits (enqueued) and the upload event.
        Pending input tokens are fed from `previous` (the step in flight)."""
        rows = self._stage(s, request_ids, pad)
        if self.followers is not None:
            tables = [self.staging.host_bufs[name].numpy()[:rows.rows, :rows.width].tobytes()
                      for name in self.table_rows.names]
            self.followers.send(Batch.of(rows, tables[0], tables[1:]))
        feed = None
        if s.pending_rows:
            if previous is None or previous.token_ids is None:
                raise RuntimeError("a step has pending input tokens but no step in flight")
            src = [previous.rows[r.request_id] for r in s.pending]
            feed = (s.pending_rows, src, previous.token_ids)
        return self.run_rows(rows, swapped_in, feed)

    def _stage(self, s: StepInputs, request_ids: list[str], pad: StepPadding | None
               ) -> ForwardRows:
        """The host side of a forward pass: padded rows, and the block table filled into its
        host buffer."""
        n = len(s.query_lens)
        ids, pos, slots = s.token_ids, s.positions, s.slot_mapping
        lora_slots = [slot for slot, q in zip(s.row_lora_slots, s.query_lens)
                      for _ in range(q)] if self.lora else []   # one per token
        seq_lens, query_lens = s.seq_lens, s.query_lens
        logits_idx = s.all_logits_indices or [0]
        num_decodes = s.num_decodes
        group_slots = s.group_slots or [[]] * (len(self.table_rows.names) - 1)  # padding alone
        width = self.table_rows.fill(self.staging.host_bufs, request_ids,
                                     [s.block_tables, *s.group_tables],
                                     None if pad is None else pad.num_seqs)
        rows = n
        if pad is not None:
            rows = pad.num_seqs
            extra_tokens, extra_seqs = pad.num_tokens - len(ids), pad.num_seqs - n
            ids, pos = ids + [0] * extra_tokens, pos + [0] * extra_tokens
            slots = slots + [-1] * extra_tokens
            group_slots = [g + [-1] * extra_tokens for g in group_slots]
            if self.lora:
                lora_slots = lora_slots + [-1] * extra_tokens
            if pad.decode:   # padding decodes: one token each over the null block
                seq_lens, query_lens = seq_lens + [1] * extra_seqs, query_lens + [1] * extra_seqs
                num_decodes = pad.num_seqs
            else:            # padding rows outside every sequence, empty padding sequences
                seq_lens, query_lens = seq_lens + [0] * extra_seqs, query_lens + [0] * extra_seqs
                num_decodes = 0
            logits_idx = s.logits_indices + [0] * (pad.num_seqs - len(s.logits_indices))
        return ForwardRows(ids, pos, slots, seq_lens, query_lens, logits_idx, num_decodes, rows,
                           width, None if pad is None else (pad.num_tokens, pad.num_seqs,
                                                             pad.decode), lora_slots,
                           group_slots)

    def run_rows(self, b: ForwardRows, swapped_in: Event | None,
                 feed: tuple[list[int], list[int], torch.Tensor] | None = None,
                 tables: Sequence[bytes] = ()) -> tuple[torch.Tensor, Event]:
        """The device side of a forward pass (every rank runs it): upload, then the plan or
        its compiled form. `tables`, when given, are the block tables of every block-table
        group (a follower's; the leader filled its host buffers in `_stage`). `feed` =
        (token rows, rows of the source, source ids on the device): those input ids are
        overwritten on the device after the upload (pending tokens)."""
        table_names = self.table_rows.names
        for name, table in zip(table_names, tables):
            self.staging.host_bufs[name].numpy()[:b.rows, :b.width] = np.frombuffer(
                table, dtype=np.int32).reshape(b.rows, b.width)
        split = split_rows(b, 1) if self.pipe is None else split_rows(
            b, self.pipe.micro_batches, self.pipe.micro_batch_tokens)
        values = {
            "input_ids": b.token_ids, "positions": b.positions, "slot_mapping": b.slot_mapping,
            "seq_lens": b.seq_lens, "query_start_loc": split.query_start_loc,
            "logits_indices": split.logits_indices,
            **{name: (b.rows, b.width) for name in table_names},
            **dict(zip(group_names("slot_mapping", len(table_names))[1:], b.group_slots))}
        if feed is not None:
            values.update(feed_rows=feed[0], feed_src=feed[1])
        if self.lora:
            values[LORA_SLOTS_FEED] = b.lora_slots
        dev, uploaded = self.staging.upload(values)
        if feed is not None:   # compute stream, after the upload: the pending ids
            ids = self.staging.dev_bufs["input_ids"]
            ids.index_copy_(0, dev["feed_rows"], feed[2].index_select(0, dev["feed_src"]))
        feeds = [self._feeds(b, dev, mb, split.whole) for mb in split.batches]
        if swapped_in is not None:
            self.blocks.swapper.wait_for_compute(swapped_in)
        pad = None if b.pad is None else self.shapes.step_padding(*b.pad)
        plan = self.shapes.plan_for(pad)
        if self.pipe is not None:
            return self.pipe.run(plan.run, feeds, split), uploaded
        logits = plan.run(feeds[0])   # asynchronous device: enqueued only
        return logits, uploaded

    def _feeds(self, b: ForwardRows, dev: dict[str, torch.Tensor], mb: MicroBatch,
               whole: bool) -> dict[str, object]:
        """A plan's feeds for the sequences and tokens of `mb` (the whole step's device
        views, unsliced, when `whole`: a decode graph replays over those buffers)."""
        def part(name: str, at: range) -> torch.Tensor:
            return dev[name] if whole else dev[name][at.start:at.stop]

        rows, tokens = mb.rows, mb.tokens
        seq_lens_host = b.seq_lens[rows.start:rows.stop]
        query_lens_host = b.query_lens[rows.start:rows.stop]
        meta = AttentionMetadata(
            num_decodes=mb.num_decodes, num_prefills=len(rows) - mb.num_decodes,
            num_decode_tokens=mb.num_decodes, num_prefill_tokens=len(tokens) - mb.num_decodes,
            block_size=self.block_size, slot_mapping=part("slot_mapping", tokens),
            block_tables=part("block_tables", rows), seq_lens=part("seq_lens", rows),
            query_start_loc=part("query_start_loc", mb.qsl), seq_lens_host=seq_lens_host,
            query_lens_host=query_lens_host, max_seq_len=max(seq_lens_host),
            max_query_len=max(query_lens_host))
        feeds = dict(zip(STEP_FEEDS, (part("input_ids", tokens), part("positions", tokens),
                                      meta, part("logits_indices", mb.logits))))
        if self._group_feeds:   # each block-table group's tables and slots, same rows
            metas = [meta] + [replace(meta, slot_mapping=part(f"slot_mapping_{g}", tokens),
                                      block_tables=part(f"block_tables_{g}", rows))
                              for g in range(1, len(self.table_rows.names))]
            feeds.update({name: metas[g] for name, g in self._group_feeds})
        feeds.update({KV_CACHE_FEED.format(layer=i): self.kv_caches[t]
                      for i, t in enumerate(self.layout.layer_tensors)})
        if self.lora:
            feeds[LORA_SLOTS_FEED] = part(LORA_SLOTS_FEED, tokens)
        return feeds

    def _sample(self, logits: torch.Tensor, sampled: list[Request],
                pending_masks: PendingMasks | None = None, offsets: Sequence[int] = (),
                drafts: dict[str, tuple[int, ...]] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, Event, list[TokenLogprobs | None]]:
        """Sample the real rows (padded logits rows go through as greedy dummies) and enqueue
        the ids' copy to the host; returns (device ids, host ids, their event, logprobs).
        A row's output position counts its pending tokens (the seed position); a verify
        row at draft offset j (speculation) is output position + j and sees the first j
        drafts as outputs (penalties), as it would have without speculation."""
        rows = [SampleRequest(r.params, len(r.output_token_ids) + r.num_pending,
                              r.prompt_token_ids, r.output_token_ids) for r in sampled]
        if drafts:
            for i, j in enumerate(offsets):
                if j:
                    r = sampled[i]
                    rows[i] = SampleRequest(
                        r.params, len(r.output_token_ids) + j, r.prompt_token_ids,
                        r.output_token_ids + list(drafts[r.request_id][:j]))
        rows += [PADDING_ROW] * (logits.shape[0] - len(rows))
        masks = None
        if pending_masks is not None:
            host = pending_masks.wait()
            bitmask = (self.staging.stage_small(TOKEN_BITMASK, host) if self._stages
                       else host.to(logits.device))
            masks = TokenMasks(pending_masks.rows, bitmask)
        result = self.sampler(logits, rows, masks)
        host = self.staging.host_sampled[:logits.shape[0]]
        return (result.token_ids, host, self.staging.stream.copy(host, result.token_ids),
                result.logprobs[:len(sampled)])

    def precompile(self) -> int:
        """Run every padded shape the device declares (decode graphs, largest first, or static
        shapes) once on padding rows only, sampling included, and on a static-shape device the
        zeroing of each power-of-two block count, before any request; returns how many step
        shapes ran."""
        shapes = self.shapes.all_paddings()
        for pad in shapes:
            logits, _ = self._forward(StepInputs(), [], pad, None)
            self._sample(logits, [])[2].wait()   # not a step: not counted in host_syncs
            self.device.synchronize()
        if self.static_shapes is not None:
            most = self.static_shapes.token_buckets[-1] // self.block_size \
                + self.static_shapes.seq_buckets[-1] + 1
            count = 1
            while count < 2 * most:
                self._lead_block_ops(BlockOps([], [KVCacheManager.NULL_BLOCK] * count, [], []))
                count *= 2
        return len(shapes)

    def launch(self, out: SchedulerOutput, kv: KVCache,
               previous: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueue one step: block ops, inputs, the plan, sampling and the copy of the ids to
        the host. `previous` is the step still in flight (its pending tokens are inputs)."""
        t0 = time.perf_counter()
        if self.overlap:   # alternate staging sets (see the module docstring)
            self.staging.next_launch()
        swapped_in = self.apply_block_ops(out, kv)
        s = build_step_inputs(out, kv)
        masks = self.token_masks.start(s.sampled) if self.token_masks is not None else None
        t1 = time.perf_counter()
        logits, uploaded = self._forward(
            s, s.row_request_ids, self.shapes.padding(s),
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
        drafts = {sched.request.request_id: sched.draft_token_ids for sched in out.scheduled
                  if sched.draft_token_ids}
        token_ids, host, readback, logprobs = self._sample(logits, s.sampled, masks,
                                                           s.sample_offsets, drafts)
        self.stage_times.add("sample", time.perf_counter() - t2)
        return LaunchedStep(out, s.sampled, logprobs, token_ids, host, readback,
                            {r.request_id: i for i, r in enumerate(s.sampled)}, prompt_lps,
                            s.sample_offsets)

    def collect(self, step: LaunchedStep) -> list[int]:
        """Wait for a launched step's ids; its sampled requests' new token ids, in order."""
        t0 = time.perf_counter()
        self.wait(step.readback)
        self.stage_times.add("sample", time.perf_counter() - t0)
        return [] if step.host is None else step.host.tolist()[:len(step.sampled)]
