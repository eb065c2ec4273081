"""The conformance matrix: seeded host inputs for every op, over dtypes and shapes.

`kernel_cases(op, padding)` lists KernelCases; each builds the op's positional arguments (in
the reference signature) on the host, from a generator seeded by the case's label, so every
kernel and the reference see the same values. Shapes cover what the engine sends: empty and
single-token batches, GQA ratios 1/2/4/8, head dims 64/80/128, block sizes 8/16/32, partial
last blocks, block tables padded with block 0, padding slots (-1) that write_kv_cache skips,
and the padded steps of devices that declare them (`Padding`): decode-graph padding rows
(slot -1, seq_len 1, a table of block 0) and static-shape padding (rows past the last
sequence, sequences with query_len 0 and seq_len 0). `compare_rows` names the output rows the
engine reads; rows it never reads (padding) are not compared.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tessellm.errors import KernelError
from tessellm.kernels.attention_metadata import AttentionMetadata, metadata_from_tables
from tessellm.graph.ops import attention_feature_dims
from tessellm.kernels.examples import fill_unowned_slots, make_example
from tessellm.kernels.registry import KernelQuery
from tessellm.quant.formats import PACKED_FORMATS, packed_example

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROW_COUNTS = (0, 1, 7)                  # empty, single-token and a few-token batch
# packed ops also at prefill size: past one 16-row tile (the AMX packed linears take 16+ rows)
PACKED_ROW_COUNTS = ROW_COUNTS + (20,)
HEADS = ((4, 4, 64), (4, 2, 80), (8, 2, 128), (8, 1, 64))   # (num_heads, num_kv_heads, head_dim)
PACKED = tuple(PACKED_FORMATS.values())     # legacy (blocks of 32) and K-quants (of 256)


@dataclass(slots=True, frozen=True)
class Padding:
    """Which padded steps the device's engine sends it (from its DevicePlugin answers)."""

    decode_graphs: bool = False     # decode_graph_sizes(...) is not empty
    static_shapes: bool = False     # static_shapes(...) is not None


@dataclass(slots=True)
class CaseInputs:
    args: list[Any]                         # host tensors in the op's reference signature
    compare_rows: int | None = None         # compare output rows [:compare_rows]; None: all


@dataclass(slots=True, frozen=True)
class KernelCase:
    label: str
    query: KernelQuery
    build: Callable[[torch.Generator], CaseInputs]

    def inputs(self) -> CaseInputs:
        return self.build(torch.Generator().manual_seed(zlib.crc32(self.label.encode())))


def _randn(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype,
           scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _case(op: str, dtype: torch.dtype, tokens: int, dims: dict[str, int], tag: str,
          build: Callable[[torch.Generator], CaseInputs]) -> KernelCase:
    query = KernelQuery(op, dtype, tokens, tuple(sorted(dims.items())))
    return KernelCase(f"{op} {_short(dtype)} T={tokens} {tag}".rstrip(), query, build)


# -- row-wise ops ------------------------------------------------------------------------------

def _row_cases(op: str) -> list[KernelCase]:
    out = []
    for dt in DTYPES:
        for T in ROW_COUNTS:
            for width in (64, 80):
                out += _row_case(op, dt, T, width)
    return out


def _zero_last(*xs: torch.Tensor) -> None:
    for x in xs:   # an all-zero row: a norm that ignores eps divides by zero there
        if x.shape[0]:
            x[-1] = 0


def _row_case(op: str, dt: torch.dtype, T: int, h: int) -> list[KernelCase]:
    def build_args(make: Callable[[torch.Generator], list[Any]]):
        return lambda gen: CaseInputs(make(gen))

    if op == "embedding":
        return [_case(op, dt, T, {"vocab": 50, "hidden": h}, f"hidden={h}", build_args(
            lambda g: [torch.randint(0, 50, (T,), generator=g), _randn(g, (50, h), dt)]))]
    if op == "linear":   # out=96: both dimensions multiples of 32, as tiled kernels want
        bias = int(h == 80)
        return [_case(op, dt, T, {"in_features": h, "out_features": n, "bias": b},
                      f"in={h} out={n} bias={b}", build_args(lambda g, n=n, b=b: [
                          _randn(g, (T, h), dt), _randn(g, (n, h), dt, h ** -0.5),
                          _randn(g, (n,), dt) if b else None]))
                for n, b in ((48, bias), (96, 1 - bias))]
    if op == "rms_norm":
        def flat(g):
            x = _randn(g, (T, h), dt)
            _zero_last(x)
            return [x, _randn(g, (h,), dt), 1e-6]

        def per_head(g):   # qwen3's q/k norm: a strided [T, heads, D] view of wider rows
            wide = _randn(g, (T, 5 * h), dt)
            x = wide[:, :4 * h].unflatten(-1, (4, h))
            _zero_last(x)
            return [x, _randn(g, (h,), dt), 1e-6]
        return [_case(op, dt, T, {"hidden": h}, f"hidden={h}", build_args(flat)),
                _case(op, dt, T, {"hidden": h, "heads": 4}, f"hidden={h} per-head view",
                      build_args(per_head))]
    if op == "fused_add_rms_norm":
        def fused(g):
            x, r = _randn(g, (T, h), dt), _randn(g, (T, h), dt)
            _zero_last(x, r)
            return [x, r, _randn(g, (h,), dt), 1e-6]
        return [_case(op, dt, T, {"hidden": h}, f"hidden={h}", build_args(fused))]
    if op == "layer_norm":
        return [_case(op, dt, T, {"hidden": h}, f"hidden={h}", build_args(lambda g: [
            _randn(g, (T, h), dt), _randn(g, (h,), dt), _randn(g, (h,), dt), 1e-5]))]
    if op == "add":
        return [_case(op, dt, T, {"hidden": h}, f"hidden={h}", build_args(
            lambda g: [_randn(g, (T, h), dt), _randn(g, (T, h), dt)]))]
    if op == "mul":
        return [_case(op, dt, T, {"features": h}, f"features={h}", build_args(
            lambda g: [_randn(g, (T, h), dt), _randn(g, (T, h), dt)]))]
    if op in ("silu", "gelu_tanh"):
        return [_case(op, dt, T, {"features": h}, f"features={h}", build_args(
            lambda g: [_randn(g, (T, h), dt, 3.0)]))]
    if op == "silu_and_mul":
        return [_case(op, dt, T, {"features": h}, f"features={h}", build_args(
            lambda g: [_randn(g, (T, 2 * h), dt, 3.0)]))]
    if op == "mul_scalar":   # a factor that bf16 and fp16 round
        return [_case(op, dt, T, {"features": h}, f"features={h}", build_args(
            lambda g: [_randn(g, (T, h), dt), math.sqrt(3072)]))]
    if op == "logit_softcap":   # values inside and far past the cap
        return [_case(op, dt, T, {"features": h}, f"features={h}", build_args(
            lambda g: [_randn(g, (T, h), dt, 8.0), 5.0]))]
    raise KernelError(f"no row-wise conformance cases for op {op!r}")


def _packed_cases(op: str) -> list[KernelCase]:
    out = []
    for dt in DTYPES:
        for fmt in PACKED:
            for T in PACKED_ROW_COUNTS:
                if op in ("linear_packed", "linear_packed_q8act"):
                    bias = int(fmt.name in ("Q4_0", "Q6_K"))
                    # an odd number of blocks too
                    k = fmt.block_weights * (3 if fmt.name in ("Q4_1", "Q5_K") else 2)
                    dims = {"in_features": k, "out_features": 40, "bias": bias,
                            "qtype": fmt.ggml_type}

                    def build(g, fmt=fmt, dt=dt, T=T, bias=bias, k=k):
                        w = packed_example(fmt, 40, k, g, scale=0.125, compute_dtype=dt)
                        return CaseInputs([_randn(g, (T, k), dt), w,
                                           _randn(g, (40,), dt) if bias else None])
                else:
                    hidden = 2 * fmt.block_weights
                    dims = {"vocab": 30, "hidden": hidden, "qtype": fmt.ggml_type}

                    def build(g, fmt=fmt, dt=dt, T=T, hidden=hidden):
                        w = packed_example(fmt, 30, hidden, g, compute_dtype=dt)
                        return CaseInputs([torch.randint(0, 30, (T,), generator=g), w])
                out.append(_case(op, dt, T, dims, fmt.name, build))
    return out


def _rotary_cases() -> list[KernelCase]:
    out = []
    for dt in DTYPES:
        for T in ROW_COUNTS:
            for nh, nkv, hd in HEADS[:3]:
                def build(g, nh=nh, nkv=nkv, hd=hd, dt=dt, T=T):
                    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
                    f = torch.outer(torch.arange(512).float(), inv)
                    cos_sin = torch.cat((f.cos(), f.sin()), -1)
                    return CaseInputs([torch.randint(0, 512, (T,), generator=g),
                                       _randn(g, (T, nh * hd), dt), _randn(g, (T, nkv * hd), dt),
                                       cos_sin, hd])
                out.append(_case("rotary_embedding", dt, T,
                                 {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd},
                                 f"heads={nh}/{nkv} head_dim={hd}", build))
    return out


# -- the paged KV cache -----------------------------------------------------------------------

def _write_kv_cases() -> list[KernelCase]:
    """T real tokens at random slots; `pad` more tokens with slot -1 (written nowhere)."""
    out = []
    shapes = ((2, 64, 16), (1, 80, 8), (4, 128, 32))
    for dt in DTYPES:
        for (nkv, hd, bs), (T, pad) in zip(shapes * 2, ((0, 0), (1, 0), (5, 1), (0, 3),
                                                         (6, 2), (1, 1))):
            def build(g, nkv=nkv, hd=hd, bs=bs, T=T, pad=pad, dt=dt):
                nblocks = max(2, math.ceil((T + 1) / bs) * 2)
                slots = torch.randperm(nblocks * bs, generator=g)[:T].tolist() + [-1] * pad
                order = torch.randperm(T + pad, generator=g).tolist()   # padding anywhere
                slot_t = torch.tensor([slots[i] for i in order], dtype=torch.int64)
                n = T + pad
                return CaseInputs([_randn(g, (n, nkv * hd), dt), _randn(g, (n, nkv * hd), dt),
                                   _randn(g, (2, nblocks, nkv, bs, hd), dt), slot_t])
            tag = f"kv_heads={nkv} head_dim={hd} block={bs} padding_slots={pad}"
            out.append(_case("write_kv_cache", dt, T + pad, {"num_kv_heads": nkv, "head_dim": hd},
                             tag, build))
    return out


@dataclass(slots=True, frozen=True)
class _AttnShape:
    heads: tuple[int, int, int]
    block_size: int
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    extra_columns: int = 0           # block-table columns past every sequence's need (block 0)
    pad_decodes: int = 0             # decode-graph padding sequences (slot -1, seq_len 1)
    pad_rows: int = 0                # static-shape padding token rows past every sequence
    pad_seqs: int = 0                # static-shape padding sequences (query_len 0, seq_len 0)
    window: int = 0                  # sliding_window (0: none)
    softcap: float = 0.0             # logit_softcap (0: none)


def _attention_inputs(g: torch.Generator, s: _AttnShape, dt: torch.dtype, num_decodes: int
                      ) -> CaseInputs:
    nh, nkv, hd = s.heads
    bs = s.block_size
    qlens = list(s.query_lens) + [1] * s.pad_decodes + [0] * s.pad_seqs
    slens = list(s.seq_lens) + [1] * s.pad_decodes + [0] * s.pad_seqs
    need = [math.ceil(n / bs) for n in s.seq_lens]
    num_blocks = sum(need) + 2                      # block 0 is the null block, one spare
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max(need, default=1) + s.extra_columns
    tables, cursor = [], 0
    for n in need:
        tables.append(perm[cursor:cursor + n] + [0] * (width - n))
        cursor += n
    tables += [[0] * width] * (s.pad_decodes + s.pad_seqs)
    meta = metadata_from_tables(qlens, slens, tables, num_decodes + s.pad_decodes, bs)
    real_tokens = sum(s.query_lens)
    if s.pad_decodes or s.pad_rows:
        slots = meta.slot_mapping.tolist()[:real_tokens]
        slots += [-1] * (s.pad_decodes + s.pad_rows)
        meta.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        meta.num_prefill_tokens += s.pad_rows
    cache = _randn(g, (2, num_blocks, nkv, bs, hd), dt)
    fill_unowned_slots(cache, meta, g)
    q = _randn(g, (real_tokens + s.pad_decodes + s.pad_rows, nh * hd), dt)
    features = [s.window, s.softcap] if s.window or s.softcap else []
    return CaseInputs([q, cache, meta, 1.0 / math.sqrt(hd)] + features,
                      compare_rows=real_tokens)


# decode: one query token per sequence; seq_len 1 (a single cached token), exact and partial
# last blocks, padded tables
_DECODE_SHAPES = (
    _AttnShape((4, 4, 64), 16, (1,), (1,)),
    _AttnShape((4, 4, 64), 16, (1, 1, 1), (17, 33, 16)),
    _AttnShape((4, 2, 80), 8, (1, 1, 1), (8, 9, 23), extra_columns=2),
    _AttnShape((8, 2, 128), 32, (1, 1), (64, 5)),
    _AttnShape((8, 1, 64), 16, (1, 1), (3, 40), extra_columns=1),
)
# prefill: whole prompts, chunks after cached context, a one-token chunk, mixed lengths
_PREFILL_SHAPES = (
    _AttnShape((4, 4, 64), 16, (1,), (1,)),
    _AttnShape((4, 2, 64), 16, (7,), (7,)),
    _AttnShape((4, 2, 80), 8, (5, 1, 9), (5, 12, 20), extra_columns=1),
    _AttnShape((8, 2, 128), 32, (6, 3), (38, 3)),
    _AttnShape((8, 1, 64), 16, (17, 2), (17, 35), extra_columns=2),
)


# sliding window (inside a block, across blocks, a one-key window) and logit soft-cap (caps
# small enough to bite), alone and together
_DECODE_FEATURE_SHAPES = (
    _AttnShape((4, 2, 64), 16, (1, 1, 1), (40, 5, 17), window=7),
    _AttnShape((8, 2, 128), 8, (1, 1), (30, 9), extra_columns=1, window=1),
    _AttnShape((4, 4, 64), 16, (1, 1), (33, 2), softcap=2.0),
    _AttnShape((8, 1, 64), 16, (1, 1, 1), (50, 16, 3), window=20, softcap=3.0),
)
_PREFILL_FEATURE_SHAPES = (
    _AttnShape((4, 2, 64), 16, (12, 3), (12, 30), window=5),
    _AttnShape((4, 2, 80), 8, (9,), (9,), extra_columns=1, window=1),
    _AttnShape((4, 4, 64), 16, (7, 4), (7, 20), softcap=2.0),
    _AttnShape((8, 2, 128), 32, (17, 2), (40, 35), window=11, softcap=3.0),
)


def _attention_cases(op: str, padding: Padding) -> list[KernelCase]:
    shapes = list(_DECODE_SHAPES if op == "attention_decode" else _PREFILL_SHAPES)
    shapes += _DECODE_FEATURE_SHAPES if op == "attention_decode" else _PREFILL_FEATURE_SHAPES
    if op == "attention_decode" and padding.decode_graphs:
        shapes += [_AttnShape((4, 2, 64), 16, (1, 1), (20, 3), extra_columns=1, pad_decodes=2)]
    if op == "attention_prefill" and padding.static_shapes:   # decodes ride as prefills
        shapes += [_AttnShape((4, 2, 64), 16, (1, 4, 1), (9, 4, 30), pad_rows=3, pad_seqs=2),
                   _AttnShape((8, 2, 128), 8, (1,), (1,), pad_rows=7, pad_seqs=3)]
    out = []
    for dt in DTYPES:
        for s in shapes:
            nh, nkv, hd = s.heads
            decodes = len(s.query_lens) if op == "attention_decode" else 0
            tag = (f"heads={nh}/{nkv} head_dim={hd} block={s.block_size} "
                   f"query_lens={list(s.query_lens)} seq_lens={list(s.seq_lens)}")
            if s.extra_columns:
                tag += f" table+{s.extra_columns}"
            if s.pad_decodes:
                tag += f" decode-graph padding x{s.pad_decodes}"
            if s.pad_rows or s.pad_seqs:
                tag += f" static padding rows={s.pad_rows} seqs={s.pad_seqs}"
            if s.window:
                tag += f" sliding_window={s.window}"
            if s.softcap:
                tag += f" logit_softcap={s.softcap}"
            tokens = sum(s.query_lens) + s.pad_decodes + s.pad_rows
            dims = {"num_heads": nh, "num_kv_heads": nkv, "head_dim": hd,
                    **attention_feature_dims(s.window, s.softcap)}
            out.append(_case(op, dt, tokens, dims, tag,
                             lambda g, s=s, dt=dt, nd=decodes: _attention_inputs(g, s, dt, nd)))
    return out


def _sample_cases() -> list[KernelCase]:
    out = []
    for T, vocab in ((1, 300), (5, 300), (3, 1000)):
        query = KernelQuery("sample_tokens", torch.float32, T, (("vocab", vocab),))
        # the profiler's seeded example: distinct logits, rows cycling every filter on and off
        out.append(KernelCase(f"sample_tokens float32 T={T} vocab={vocab}", query,
                              lambda g, q=query: CaseInputs(make_example(q, "cpu"))))
    return out


def _greedy_cases() -> list[KernelCase]:
    out = []
    for dt in DTYPES:
        for T, vocab in ((1, 300), (3, 1000), (9, 5003)):
            query = KernelQuery("greedy_tokens", dt, T, (("vocab", vocab),))
            # the profiler's seeded example: ties at the maximum, NaNs, plain rows
            out.append(KernelCase(f"greedy_tokens {_short(dt)} T={T} vocab={vocab}", query,
                                  lambda g, q=query: CaseInputs(make_example(q, "cpu"))))
    return out


def _bitmask_cases() -> list[KernelCase]:
    out = []
    for dt in (torch.float32, torch.bfloat16):
        # vocabularies that are and are not a multiple of 32 (bits past the vocabulary set)
        for T, vocab in ((1, 64), (3, 1000), (5, 5003), (9, 32000), (2, 49153)):
            query = KernelQuery("apply_token_bitmask", dt, T, (("vocab", vocab),))
            out.append(KernelCase(f"apply_token_bitmask {_short(dt)} T={T} vocab={vocab}", query,
                                  lambda g, q=query: CaseInputs(make_example(q, "cpu"))))
    return out


_ROW_OPS = ("embedding", "linear", "rms_norm", "fused_add_rms_norm", "layer_norm", "add", "mul",
            "silu", "gelu_tanh", "silu_and_mul", "mul_scalar", "logit_softcap")


def kernel_cases(op: str, padding: Padding = Padding()) -> list[KernelCase]:
    """Every conformance case of `op`; KernelError for an op the matrix does not know."""
    if op in _ROW_OPS:
        return _row_cases(op)
    if op in ("linear_packed", "linear_packed_q8act", "embedding_packed"):
        return _packed_cases(op)
    if op == "rotary_embedding":
        return _rotary_cases()
    if op == "write_kv_cache":
        return _write_kv_cases()
    if op in ("attention_decode", "attention_prefill"):
        return _attention_cases(op, padding)
    if op == "sample_tokens":
        return _sample_cases()
    if op == "greedy_tokens":
        return _greedy_cases()
    if op == "apply_token_bitmask":
        return _bitmask_cases()
    from tessellm.kernels.moe_examples import MOE_OPS
    if op in MOE_OPS:
        from tessellm.testing.moe_cases import moe_cases
        return moe_cases(op)
    if op == "lora_add":
        from tessellm.testing.lora_cases import lora_cases
        return lora_cases()
    raise KernelError(f"the conformance kit has no cases for op {op!r}")


def attention_metadata_to(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    """The same metadata with its tensors on `device` (host lists unchanged)."""
    return AttentionMetadata(
        meta.num_decodes, meta.num_prefills, meta.num_decode_tokens, meta.num_prefill_tokens,
        meta.block_size, meta.slot_mapping.to(device), meta.block_tables.to(device),
        meta.seq_lens.to(device), meta.query_start_loc.to(device), list(meta.seq_lens_host),
        list(meta.query_lens_host), meta.max_seq_len, meta.max_query_len)
