"""A pipelined step's split into micro-batches (tessellm.parallel.micro_batches), no
processes: whole sequences, contiguous, balanced by tokens, each micro-batch's offsets and
logits rows re-based at its first token, a micro-batch that samples nothing computing one
dummy row, and the logits put back in the step's order (sampled rows, then prompt rows)."""
from __future__ import annotations

import pytest
import torch

from tessellm.engine.step_inputs import ForwardRows
from tessellm.parallel.micro_batches import cut_points, split_rows


def _rows(query_lens: list[int], logits: list[int], num_decodes: int = 0,
          pad=None) -> ForwardRows:
    t = sum(query_lens)
    return ForwardRows(list(range(t)), list(range(t)), list(range(t)), [q + 3 for q in query_lens],
                       query_lens, logits, num_decodes, len(query_lens), 1, pad)


@pytest.mark.parametrize("lens,count,want", [
    ([1, 1, 1, 1], 2, [2]), ([1, 1, 1, 40], 2, [3]), ([40, 1, 1, 1], 2, [1]),
    ([1, 1, 1], 3, [1, 2]), ([5, 5, 5, 5, 5, 5], 3, [2, 4]), ([30, 1, 1], 3, [1, 2])])
def test_cuts_balance_tokens_and_keep_every_micro_batch_non_empty(lens, count, want):
    assert cut_points(lens, count) == want


def test_a_mixed_step_splits_by_whole_sequences_with_local_offsets():
    # 2 decodes (tokens 0, 1), then prefills of 4 (2..5, samples 5) and 6 tokens (6..11,
    # a chunk: samples nothing); prompt logprobs read rows 2, 3, 4 after the sampled ones
    b = _rows([1, 1, 4, 6], [0, 1, 5, 2, 3, 4], num_decodes=2)
    split = split_rows(b, 2)
    first, second = split.batches
    assert (first.rows, first.tokens, first.num_decodes) == (range(0, 3), range(0, 6), 2)
    assert (second.rows, second.tokens, second.num_decodes) == (range(3, 4), range(6, 12), 0)
    qsl = split.query_start_loc
    assert qsl[first.qsl.start:first.qsl.stop] == [0, 1, 2, 6]
    assert qsl[second.qsl.start:second.qsl.stop] == [0, 6]
    li = split.logits_indices
    assert li[first.logits.start:first.logits.stop] == [0, 1, 5, 2, 3, 4]
    assert li[second.logits.start:second.logits.stop] == [0]   # a dummy row
    assert split.order is None   # the first batch's rows are the step's, in order
    parts = [torch.arange(6.0).unsqueeze(1), torch.tensor([[-1.0]])]
    assert split.assemble(parts).squeeze(1).tolist() == [0, 1, 2, 3, 4, 5]


def test_prompt_rows_of_several_micro_batches_come_back_after_every_sampled_row():
    # two prefills of 3 tokens, each sampled (rows 2, 5) and each with prompt rows
    b = _rows([3, 3], [2, 5, 0, 1, 3, 4])
    split = split_rows(b, 2)
    li = split.logits_indices
    assert li == [2, 0, 1, 2, 0, 1]        # batch 0: 2, 0, 1; batch 1: 5-3, 3-3, 4-3
    assert split.order == [0, 3, 1, 2, 4, 5]
    parts = [torch.tensor([[2.0], [0.0], [1.0]]), torch.tensor([[5.0], [3.0], [4.0]])]
    assert split.assemble(parts).squeeze(1).tolist() == [2, 5, 0, 1, 3, 4]


def test_one_micro_batch_when_padded_or_asked_or_a_single_sequence():
    assert split_rows(_rows([1, 1], [0, 1], 2, pad=(4, 4, True)), 2).whole
    padded = _rows([3, 0], [2, 0], pad=(8, 2, False))   # 5 padding rows outside every sequence
    padded.token_ids += [0] * 5
    assert split_rows(padded, 2).batches[0].tokens == range(8)
    assert split_rows(_rows([1, 1], [0, 1], 2), 1).whole
    whole = split_rows(_rows([7], [6]), 4)
    assert whole.whole and whole.query_start_loc == [0, 7] and whole.logits_indices == [6]
    assert len(split_rows(_rows([1, 1, 1], [0, 1, 2], 3), 8).batches) == 3


def test_micro_batches_of_too_few_tokens_are_not_made():
    decodes = _rows([1] * 16, list(range(16)), 16)
    assert split_rows(decodes, 2, min_tokens=32).whole      # 16 tokens: one pass
    assert len(split_rows(decodes, 2, min_tokens=8).batches) == 2
    prompts = _rows([64, 64, 64], [63, 127, 191])
    assert len(split_rows(prompts, 4, min_tokens=32).batches) == 3   # one per sequence
    assert len(split_rows(prompts, 4, min_tokens=96).batches) == 2
