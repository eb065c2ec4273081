"""What attention kernels need to read and write the paged KV cache for one step.

Batch layout: the step's sequences are ordered decodes first (one query token each), then
prefills (one or more query tokens: a prompt chunk, or a recomputation). Tokens are flattened
in that order. For sequence i, its query tokens are rows query_start_loc[i]:query_start_loc[i+1]
and they sit at positions seq_lens[i] - query_len .. seq_lens[i]-1 of the sequence; its KV lives
in blocks block_tables[i, :ceil(seq_lens[i] / block_size)]. Slot s is row s % block_size of
block s // block_size. A slot of -1 marks a padding token (a decode batch padded to a captured
graph's size): write_kv_cache writes nothing for it, and its sequence (seq_len 1, a table of
block 0) produces an output row nobody reads.

KV cache of one layer: a tensor [2, num_blocks, num_kv_heads, block_size, head_dim] (K then V;
head-major inside a block, so one head's rows of a block are contiguous).
Contract kernels may rely on: every slot reachable through a block-table row (including slots
past seq_len in a sequence's last block, and padding entries, which point at block 0) holds
finite values; the engine zeroes blocks when they are handed out and keeps block 0 zero. Only
slots < seq_len hold this sequence's K/V: kernels must mask the others' scores.
The host-side lists mirror the tensors so that kernels that loop per sequence need no
device-to-host sync. A metadata object describes one step: every layer gets the same object, and
its tensors are not edited while the step runs (kernels may check and convert them once per
object).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int
    block_size: int
    slot_mapping: torch.Tensor       # [num_tokens] int64
    block_tables: torch.Tensor       # [num_seqs, max_blocks] int32 (padding: 0)
    seq_lens: torch.Tensor           # [num_seqs] int32
    query_start_loc: torch.Tensor    # [num_seqs + 1] int32
    seq_lens_host: list[int]
    query_lens_host: list[int]
    max_seq_len: int
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return self.num_decodes + self.num_prefills

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    def prefill_part(self) -> "AttentionMetadata":
        """The metadata of the prefill sequences alone (token rows re-based at 0)."""
        d = self.num_decodes
        qsl = self.query_start_loc[d:] - self.num_decode_tokens
        return AttentionMetadata(
            num_decodes=0, num_prefills=self.num_prefills, num_decode_tokens=0,
            num_prefill_tokens=self.num_prefill_tokens, block_size=self.block_size,
            slot_mapping=self.slot_mapping[self.num_decode_tokens:],
            block_tables=self.block_tables[d:], seq_lens=self.seq_lens[d:],
            query_start_loc=qsl, seq_lens_host=self.seq_lens_host[d:],
            query_lens_host=self.query_lens_host[d:],
            max_seq_len=max(self.seq_lens_host[d:], default=0),
            max_query_len=max(self.query_lens_host[d:], default=0))

    def decode_part(self) -> "AttentionMetadata":
        d = self.num_decodes
        return AttentionMetadata(
            num_decodes=d, num_prefills=0, num_decode_tokens=d, num_prefill_tokens=0,
            block_size=self.block_size, slot_mapping=self.slot_mapping[:d],
            block_tables=self.block_tables[:d], seq_lens=self.seq_lens[:d],
            query_start_loc=self.query_start_loc[:d + 1], seq_lens_host=self.seq_lens_host[:d],
            query_lens_host=self.query_lens_host[:d],
            max_seq_len=max(self.seq_lens_host[:d], default=0), max_query_len=1 if d else 0)


def metadata_from_tables(query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                         num_decodes: int, block_size: int,
                         device: str | torch.device = "cpu") -> AttentionMetadata:
    """Metadata for explicit block tables (the first `num_decodes` sequences are decodes):
    slots derived from the tables, tables padded with block 0 (the null block)."""
    slots = [table[p // block_size] * block_size + p % block_size
             for q, s, table in zip(query_lens, seq_lens, tables) for p in range(s - q, s)]
    width = max(len(t) for t in tables)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    n_dec = sum(query_lens[:num_decodes])
    return AttentionMetadata(
        num_decodes=num_decodes, num_prefills=len(query_lens) - num_decodes,
        num_decode_tokens=n_dec, num_prefill_tokens=qsl[-1] - n_dec, block_size=block_size,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens_host=list(seq_lens), query_lens_host=list(query_lens),
        max_seq_len=max(seq_lens), max_query_len=max(query_lens))
