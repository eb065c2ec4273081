"""Paged attention as C kernels (native/paged_attention.c), called through ctypes: decode
(one query token per sequence) and prefill (every query token of each sequence, causal, after
any cached context).

Both read K/V in place through the block tables: no gather copy, no padding, float32 math.
They support float32 and bfloat16 caches on the CPU, and the reference's sliding_window and
logit_softcap (a window's first block is read from its first key on; tanhf per score in the
decode, a 16-lane tanh from the vector exp in the prefill's tiles).
The C side checks every index it reads with (sequence lengths against the table width, block
ids against the pool, heads against KV heads, the prefill's query offsets against the rows of
q and the sequence lengths) and returns a code per problem, raised here as a ValueError naming
it.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from tessellm.plugin_api import AttentionMetadata, KernelQuery
from tessellm_cpu.native_build import build_library, entry_point
from tessellm_cpu.native_team import TeamEntry, TeamKernelC

SOURCE = Path(__file__).with_name("native") / "paged_attention.c"
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# paged_attention.c's PD_* return codes
PD_OK, PD_ERR_ALLOC, PD_ERR_SHAPE, PD_ERR_HEADS = 0, 1, 2, 3
PD_ERR_SEQ_LEN, PD_ERR_TABLE_WIDTH, PD_ERR_BLOCK_ID, PD_ERR_QUERY = 4, 5, 6, 7


class DecodeArgs(ctypes.Structure):
    _fields_ = [("q", _ptr), ("kv", _ptr), ("block_tables", _ptr), ("bt_stride", _i64),
                ("bt_cols", _i64), ("seq_lens", _ptr), ("out", _ptr), ("B", _i64), ("H", _i64),
                ("NKV", _i64), ("D", _i64), ("BS", _i64), ("NB", _i64), ("scale", _f32),
                ("threads", ctypes.c_int), ("info", _ptr), ("scratch", _ptr),
                ("window", _i64), ("softcap", _f32)]


class PrefillArgs(ctypes.Structure):
    _fields_ = [("q", _ptr), ("kv", _ptr), ("block_tables", _ptr), ("bt_stride", _i64),
                ("bt_cols", _i64), ("seq_lens", _ptr), ("query_start_loc", _ptr), ("out", _ptr),
                ("B", _i64), ("NT", _i64), ("H", _i64), ("NKV", _i64), ("D", _i64),
                ("BS", _i64), ("NB", _i64), ("scale", _f32), ("threads", ctypes.c_int),
                ("info", _ptr), ("scratch", _ptr), ("window", _i64), ("softcap", _f32)]


class _PagedAttention(TeamKernelC):
    """The loaded library's entry points of one kind (`kind`: decode or prefill), by dtype.
    `code_hash` identifies the built code (source, flags, compiler, CPU) for the profiler's
    cache."""

    kind: str
    args_type: type[ctypes.Structure]

    def __init__(self) -> None:
        native = build_library(SOURCE)
        self.code_hash = native.key
        self._entries = {dt: TeamEntry(native, f"paged_{self.kind}_{sfx}", self.args_type)
                         for dt, sfx in ((torch.float32, "f32"), (torch.bfloat16, "bf16"))}
        self._scratch = entry_point(native, f"paged_{self.kind}_scratch")
        self._scratch.argtypes, self._scratch.restype = [_ptr], ctypes.c_int64
        # The step's tables and lengths, checked and converted once per metadata object (every
        # layer of a step passes the same one): (meta, its block_tables and seq_lens as given,
        # the checked tables, the int32 lengths). A field given a new tensor is seen as new.
        self._step: tuple[Any, ...] | None = None

    @staticmethod
    def supports(query: KernelQuery) -> bool:
        return query.dtype in (torch.float32, torch.bfloat16)

    def _step_tables(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        step = self._step
        if step is not None and step[0] is meta and step[1] is meta.block_tables \
                and step[2] is meta.seq_lens:
            return step[3], step[4]
        num_seqs = meta.num_seqs
        tables = meta.block_tables
        if tables.dim() != 2 or tables.shape[0] < num_seqs:
            raise ValueError(f"native {self.kind} needs a [{num_seqs}, max_blocks] block table, "
                             f"got {tuple(tables.shape)}")
        if tables.dtype != torch.int32 or tables.stride(-1) != 1:
            tables = tables.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        if seq_lens.numel() != num_seqs:
            raise ValueError(f"{seq_lens.numel()} sequence lengths for {num_seqs} sequences")
        if not (tables.is_cpu and seq_lens.is_cpu):
            raise ValueError(f"native {self.kind} reads block tables and lengths on the CPU")
        self._step = (meta, meta.block_tables, meta.seq_lens, tables, seq_lens)
        return tables, seq_lens

    def _checked(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata):
        """(entry, q contiguous, tables, seq_lens, the cache's sizes, builder) after the
        checks both kinds share; the builder is None when not recording (or declined: the
        tables or q needed a copy)."""
        entry = self._entries.get(q.dtype)
        if entry is None or kv_cache.dtype is not q.dtype:
            raise TypeError(f"native {self.kind} supports float32/bfloat16, got {q.dtype} "
                            f"with a {kv_cache.dtype} cache")
        if not (kv_cache.is_cpu and q.is_cpu):
            raise ValueError(f"native {self.kind} runs on CPU tensors")
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
            raise ValueError(f"native {self.kind} needs a contiguous [2, blocks, kv_heads, "
                             f"block_size, head_dim] KV cache, got shape {tuple(kv_cache.shape)}")
        _, num_blocks, num_kv_heads, block_size, head_dim = kv_cache.shape
        tables, seq_lens = self._step_tables(meta)
        if q.dim() != 2 or q.shape[1] % head_dim != 0:
            raise ValueError(f"native {self.kind} needs q of [tokens, heads * {head_dim}], got "
                             f"{tuple(q.shape)}")
        if block_size != meta.block_size:
            raise ValueError(f"the KV cache has blocks of {block_size} tokens, the metadata "
                             f"{meta.block_size}")
        b = self._builder()
        if b is not None and not (tables is meta.block_tables and seq_lens is meta.seq_lens
                                  and q.is_contiguous()):
            b.decline(f"{self.kind} attention converts its tables, lengths or q")
            b = None
        return entry, q.contiguous(), tables, seq_lens, (num_blocks, num_kv_heads, block_size,
                                                         head_dim), b

    def _launch_attention(self, entry: TeamEntry, b: Any, q: torch.Tensor,
                          kv_cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                          sizes: tuple[int, int, int, int], scale: float,
                          starts: torch.Tensor | None = None, sliding_window: int = 0,
                          logit_softcap: float = 0.0) -> torch.Tensor:
        """Run (or record) the entry into a new tensor like q (`starts`: the prefill's query
        offsets); a nonzero return code raises the error it names."""
        num_blocks, num_kv_heads, block_size, head_dim = sizes
        num_heads = q.shape[1] // head_dim
        out = self._empty(b, q.shape, q.dtype)
        info = (ctypes.c_int64 * 2)(-1, -1)
        common = (q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                  tables.shape[1], seq_lens.data_ptr())
        sizes_ = (num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale)
        if starts is None:
            args = DecodeArgs(*common, out.data_ptr(), seq_lens.shape[0], *sizes_, 0,
                              ctypes.addressof(info), 0, max(0, int(sliding_window)),
                              max(0.0, float(logit_softcap)))
        else:
            args = PrefillArgs(*common, starts.data_ptr(), out.data_ptr(), seq_lens.shape[0],
                               q.shape[0], *sizes_, 0, ctypes.addressof(info), 0,
                               max(0, int(sliding_window)), max(0.0, float(logit_softcap)))
        if b is not None:
            args.threads = b.threads
            args.scratch = b.scratch(int(self._scratch(ctypes.byref(args))))
        kind, rows = self.kind, q.shape[0]
        starts_list = None if starts is None else starts

        def raise_error(rc: int) -> None:
            if rc == PD_ERR_QUERY and starts_list is not None:
                raise ValueError(f"native prefill: the query offsets {starts_list.tolist()} do "
                                 f"not rise from 0 to the {rows} rows of q within the sequence "
                                 f"lengths {seq_lens.tolist()} (at sequence {info[0]})")
            _raise(kind, rc, info[0], info[1], seq_lens, tables, num_heads, num_kv_heads,
                   head_dim, block_size, num_blocks)
        if b is None:
            rc = entry.run(ctypes.byref(args))
            if rc:
                raise_error(rc)
            return out
        from tessellm_cpu.program_builder import NativeCall
        b.node(NativeCall(entry.team, args, raise_error, f"attention_{kind}", (info,)))
        return out


class NativeDecode(_PagedAttention):
    """attention_decode: one query token per sequence (the last of each)."""

    kind, args_type = "decode", DecodeArgs

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, sliding_window: int = 0,
                 logit_softcap: float = 0.0) -> torch.Tensor:
        entry, q, tables, seq_lens, sizes, b = self._checked(q, kv_cache, meta)
        if q.shape[0] != seq_lens.shape[0]:
            raise ValueError(f"native decode needs q of [{seq_lens.shape[0]}, heads * "
                             f"{sizes[3]}] (one token per sequence), got {tuple(q.shape)}")
        return self._launch_attention(entry, b, q, kv_cache, tables, seq_lens, sizes, scale,
                                      None, sliding_window, logit_softcap)


class NativePrefill(_PagedAttention):
    """attention_prefill: every query token of each sequence, causal over the cached context
    and the tokens before it (query rows by meta.query_start_loc)."""

    kind, args_type = "prefill", PrefillArgs

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, sliding_window: int = 0,
                 logit_softcap: float = 0.0) -> torch.Tensor:
        entry, q, tables, seq_lens, sizes, b = self._checked(q, kv_cache, meta)
        starts = meta.query_start_loc
        if starts.dtype is not torch.int32 or not starts.is_contiguous():
            if b is not None:
                b.decline("prefill attention converts its query offsets")
                b = None
            starts = starts.to(torch.int32).contiguous()
        if starts.numel() != seq_lens.shape[0] + 1 or not starts.is_cpu:
            raise ValueError(f"native prefill needs {seq_lens.shape[0] + 1} query offsets on "
                             f"the CPU, got {starts.numel()}")
        return self._launch_attention(entry, b, q, kv_cache, tables, seq_lens, sizes, scale,
                                      starts, sliding_window, logit_softcap)


def _raise(kind: str, rc: int, seq: int, col: int, seq_lens: torch.Tensor,
           tables: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
           block_size: int, num_blocks: int) -> None:
    if rc == PD_ERR_ALLOC:
        raise MemoryError(f"native {kind} could not allocate its scratch buffers")
    if rc == PD_ERR_SHAPE:
        raise ValueError(f"native {kind}: invalid sizes (heads {num_heads}, kv heads "
                         f"{num_kv_heads}, head_dim {head_dim}, block_size {block_size}, "
                         f"{num_blocks} blocks)")
    if rc == PD_ERR_HEADS:
        raise ValueError(f"native {kind}: {num_heads} query heads are not a multiple of "
                         f"{num_kv_heads} KV heads")
    if rc == PD_ERR_SEQ_LEN:
        raise ValueError(f"native {kind}: sequence {seq} has a negative length "
                         f"{int(seq_lens[seq])}")
    if rc == PD_ERR_TABLE_WIDTH:
        raise ValueError(f"native {kind}: sequence {seq} has length {int(seq_lens[seq])}, "
                         f"needing {col} blocks of {block_size} tokens, but the block table "
                         f"has only {tables.shape[1]} columns")
    if rc == PD_ERR_BLOCK_ID:
        raise ValueError(f"native {kind}: sequence {seq} uses block id "
                         f"{int(tables[seq, col])} (table column {col}), outside the pool of "
                         f"{num_blocks} blocks")
    raise RuntimeError(f"native {kind} failed with unknown code {rc}")
