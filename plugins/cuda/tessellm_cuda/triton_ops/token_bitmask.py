"""apply_token_bitmask with reference.apply_token_bitmask's semantics: in place, -inf for every
token whose bit is 0 in its row's int32 bitmask words (bit t % 32 of word t // 32; bits past
the vocabulary ignored). Grid: (rows, vocabulary tiles of BLOCK tokens); each program loads its
BLOCK / 32 words once and expands them to per-token bits with shifts."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, run_all

_BLOCK = 1024


@triton.jit
def _apply_token_bitmask_kernel(x_ptr, mask_ptr, vocab, x_stride, mask_stride,
                                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    words = tl.load(mask_ptr + row * mask_stride + tokens // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    src = x_ptr + row * x_stride + tokens
    x = tl.load(src, mask=in_vocab, other=0.0)
    tl.store(src, tl.where(allowed, x, float("-inf")).to(x.dtype), mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place over logits [n, vocab] (rows may be strided; tokens contiguous)."""
    run_all(apply_token_bitmask_launches(logits, bitmask))


def apply_token_bitmask_launches(logits: torch.Tensor, bitmask: torch.Tensor) -> list[Launch]:
    """The launch of apply_token_bitmask, not run."""
    n, vocab = logits.shape
    if n == 0 or vocab == 0:
        return []
    if logits.stride(1) != 1:
        raise ValueError("apply_token_bitmask needs logits rows with contiguous tokens")
    words = bitmask if bitmask.stride(-1) == 1 else bitmask.contiguous()
    grid = (n, triton.cdiv(vocab, _BLOCK))
    return [Launch(_apply_token_bitmask_kernel, grid,
                   (logits, words, vocab, logits.stride(0), words.stride(0)),
                   dict(BLOCK=_BLOCK, num_warps=4))]
