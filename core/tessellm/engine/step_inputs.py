"""The host-side description of one engine step: its rows (StepInputs, built from a
SchedulerOutput), what it is padded to (StepPadding), the rows of its forward pass as staged
(ForwardRows), and a step on the device (LaunchedStep).

Rows follow the scheduler: decodes first, then prefills, as AttentionMetadata requires. A
request's pending token (async scheduling: sampled by the step in flight, not read back) is
an input row whose id the runner feeds on the device; at most one per request per step.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tessellm.cache.kv_groups import KVCache
from tessellm.cache.kv_manager import KVCacheManager
from tessellm.device import Event
from tessellm.engine.token_logprobs import TokenLogprobs
from tessellm.request import Request
from tessellm.scheduler import SchedulerOutput


@dataclass(slots=True, frozen=True)
class StepPadding:
    """What a step is padded to: `num_tokens` rows, `num_seqs` sequences, logits rows as many
    as sequences; `decode` keeps every row a decode (graph steps), else all are prefills.
    `key` is the shape the device compiles the plan for."""

    num_tokens: int
    num_seqs: int
    decode: bool
    key: object


@dataclass(slots=True)
class ForwardRows:
    """One forward pass as staged on the host, padding applied: each input's rows, how many
    sequences (`rows`) and block-table columns (`width`) it has, and the padding
    (num_tokens, num_seqs, decode) when the step is padded. A tensor-parallel leader sends
    these to its workers (parallel.messages.Batch) with the block table."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    logits_indices: list[int]
    num_decodes: int
    rows: int
    width: int
    pad: tuple[int, int, bool] | None = None
    lora_slots: list[int] = field(default_factory=list)   # per token row (LoRA engines)
    group_slots: list[list[int]] = field(default_factory=list)   # as StepInputs'


def bucket_at_least(buckets: Sequence[int], n: int) -> int | None:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass(slots=True)
class StepInputs:
    """Host-side description of one step (lists; converted to tensors once)."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    block_tables: list[Sequence[int]] = field(default_factory=list)  # read-only views
    row_request_ids: list[str] = field(default_factory=list)   # whose table each row is
    seq_lens: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    sampled: list[Request] = field(default_factory=list)
    # per sampled row: its offset among the request's rows that sample (speculation: draft
    # position j of a verify entry samples the token after draft j; 0 otherwise)
    sample_offsets: list[int] = field(default_factory=list)
    num_decodes: int = 0
    pending_rows: list[int] = field(default_factory=list)   # token rows whose id is pending
    pending: list[Request] = field(default_factory=list)    # ... and whose pending token
    # prompt logprobs: token rows whose logits are read besides the sampled ones, and per
    # request (request, first prompt position, how many positions) in that order
    prompt_rows: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[Request, int, int]] = field(default_factory=list)
    row_lora_slots: list[int] = field(default_factory=list)   # per row: its adapter's slot
    # hybrid models: per block-table group after the first (tessellm.cache.kv_groups), its
    # slot mapping and block tables, as slot_mapping and block_tables are the first group's
    group_slots: list[list[int]] = field(default_factory=list)
    group_tables: list[list[Sequence[int]]] = field(default_factory=list)

    @property
    def all_logits_indices(self) -> list[int]:
        """The sampled rows' logits indices, then the prompt logprobs' rows."""
        return self.logits_indices + self.prompt_rows if self.prompt_rows \
            else self.logits_indices

@dataclass(slots=True)
class LaunchedStep:
    """A step on the device: `token_ids` (one per logits row, padded rows included) and
    their host copy (`host`, complete once `readback` is waited), or for a step that samples
    nothing the upload event `collect` waits instead. `rows` maps each sampled request's id
    to its row of token_ids, for the next step's pending inputs. `prompt_logprobs`: per
    request id, the prompt tokens' logprobs this step computed (in position order)."""

    out: SchedulerOutput
    sampled: list[Request]
    logprobs: list[TokenLogprobs | None]
    token_ids: torch.Tensor | None
    host: torch.Tensor | None
    readback: Event
    rows: dict[str, int]
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    sample_offsets: list[int] = field(default_factory=list)   # as StepInputs'


def blocks_written_in_full(out: SchedulerOutput, kv: KVCache,
                           fresh: list[int]) -> list[int]:
    """The blocks of `fresh` whose every slot the step writes: each scheduled request's
    blocks that lie wholly inside the tokens it computes, in every block-table group (in
    every layer the attention site writes a step's K/V before it reads the cache, so such a
    block is never read unwritten)."""
    if not fresh:
        return []
    bs, wanted, full = kv.block_size, set(fresh), []
    for sched in out.scheduled:
        if sched.num_tokens < bs:
            continue
        start = sched.request.num_computed_tokens
        for m in kv.groups:
            table = m.block_table_view(sched.request.request_id)
            full += [b for b in table[-(-start // bs):(start + sched.num_tokens) // bs]
                     if b in wanted]
    return full


def build_step_inputs(out: SchedulerOutput, kv: KVCache) -> StepInputs:
    """One row per scheduled request; a logits index (and sampled request) per request that
    completes in this step, followed by one per sibling forking from it (out.forks): they
    sample from its row, each with its own SamplingParams and seed. A request that wants
    prompt logprobs also has its computed prompt positions' rows read (prompt_rows): position
    p's logits give the logprob of prompt token p + 1, for p from the entries it has up to
    the second-to-last prompt token (the last one's logits are the sampled row).

    An entry with drafts (speculation: the request's last token, then d drafts) is d + 1
    decode rows, one token each at positions start..start+d, row j attending to the first
    start + j + 1 positions of the same block table (the step writes every row's KV before
    any row attends, so row j sees the drafts before it): a verify step is a decode step of
    more rows, on the decode kernels and programs. Each row is sampled (sample_offsets j).
    Every row carries its request's LoRA slot (request.lora_slot, -1: none). A hybrid model's
    other block-table groups get their slots and tables row for row (group_slots/tables)."""
    main, *others = kv.groups
    s = StepInputs(group_slots=[[] for _ in others], group_tables=[[] for _ in others])
    for sched in out.scheduled:
        r, n, drafts = sched.request, sched.num_tokens, sched.draft_token_ids
        start, stop = r.num_computed_tokens, r.num_computed_tokens + n
        if drafts:
            _verify_rows(s, r, drafts, start, main)
            _group_rows(s, others, r, start, start + len(drafts) + 1, len(drafts) + 1)
            continue
        known = r.num_known_tokens
        if stop > known:   # its pending token (async scheduling): fed on the device
            if stop - known != 1 or r.num_pending != 1:
                raise RuntimeError(f"request {r.request_id!r}: {stop - known} pending input "
                                   f"tokens in one step (at most one may be in flight)")
            s.pending_rows.append(len(s.token_ids) + known - start)
            s.pending.append(r)
        if r.wants_prompt_logits:
            first = max(start, len(r.prompt_logprobs))
            last = min(stop, r.num_prompt_tokens - 1)
            if first < last:
                row0 = len(s.token_ids) - start
                s.prompt_rows += range(row0 + first, row0 + last)
                s.prompt_spans.append((r, first, last - first))
        s.token_ids += r.token_ids_slice(start, stop)
        s.positions += range(start, stop)
        s.slot_mapping += main.slot_mapping(r, start, stop)
        s.block_tables.append(main.block_table_view(r.request_id))
        _group_rows(s, others, r, start, stop, 1)
        s.row_request_ids.append(r.request_id)
        s.row_lora_slots.append(r.lora_slot)
        s.seq_lens.append(stop)
        s.query_lens.append(n)
        if stop == r.num_tokens:  # fully computed after this step: sample its next token
            s.logits_indices.append(len(s.token_ids) - 1)
            s.sampled.append(r)
            s.sample_offsets.append(0)
            for child in out.forks.get(r.request_id, ()):   # n > 1: the same row again
                s.logits_indices.append(len(s.token_ids) - 1)
                s.sampled.append(child)
                s.sample_offsets.append(0)
    while s.num_decodes < len(s.query_lens) and s.query_lens[s.num_decodes] == 1:
        s.num_decodes += 1
    return s


def _group_rows(s: StepInputs, others: Sequence[KVCacheManager], r: Request, start: int,
                stop: int, rows: int) -> None:
    """The slots of positions start..stop-1 and `rows` rows of the request's table in each
    block-table group after the first."""
    for g, m in enumerate(others):
        s.group_slots[g] += m.slot_mapping(r, start, stop)
        s.group_tables[g] += [m.block_table_view(r.request_id)] * rows


def _verify_rows(s: StepInputs, r: Request, drafts: Sequence[int], start: int,
                 kv: KVCacheManager) -> None:
    """A verify entry's d + 1 decode rows (see build_step_inputs)."""
    count = len(drafts) + 1
    table = kv.block_table_view(r.request_id)
    first = len(s.token_ids)
    s.token_ids += r.token_ids_slice(start, start + 1)
    s.token_ids += drafts
    s.positions += range(start, start + count)
    s.slot_mapping += kv.slot_mapping(r, start, start + count)
    s.block_tables += [table] * count
    s.row_request_ids += [r.request_id] * count
    s.row_lora_slots += [r.lora_slot] * count
    s.seq_lens += range(start + 1, start + count + 1)
    s.query_lens += [1] * count
    s.logits_indices += range(first, first + count)
    s.sampled += [r] * count
    s.sample_offsets += range(count)
