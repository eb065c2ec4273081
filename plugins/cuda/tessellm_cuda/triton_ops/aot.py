"""Every Triton launch the engine makes, compiled ahead of time for GPU targets without a GPU.

`engine_launches()` calls the plugin's own host functions (`*_launches` of each kernel module)
on meta tensors (shapes, strides and dtypes, no memory) for the model shapes in MODEL_SHAPES,
the dtypes float32 / bfloat16 / float16 and the batch shapes of decode, prefill and sampling,
so grid, constexprs, num_warps / num_stages and the argument specializations are exactly those
of a real launch. `compile_report()` compiles one launch through `JITFunction.warmup` (Triton's
front end, then the bundled ptxas, as a launch on that GPU would) with a stand-in driver that
only names the target, and reads the resources from ptxas' own `-v` log: registers, spill
stores / loads, stack frame; shared memory is Triton's allocation plus ptxas' static smem.

A launch fails the check on a compile error, spill stores above MAX_SPILL_BYTES, shared
memory above the target's per-block limit, or registers x threads above the register file.
Run `python -m tessellm_cuda.triton_ops.aot [--arch 90,80] [--json]` with TRITON_INTERPRET=0
(it decides, at import, whether the kernels compile or are interpreted).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget

from tessellm.plugin_api import AttentionMetadata, PackedWeight
from tessellm.quant.formats import PACKED_FORMATS, row_bytes

from .launch import Launch

# Spill stores a kernel may have, in bytes per thread: a few registers' worth, as ptxas may
# spill around a loop (the fp32 rotary on sm_90 with ptxas 13: 4 bytes); a tile too large
# for the register file spills kilobytes (the fp32 prefill's 64-row tiles: 15 KB on sm_80).
MAX_SPILL_BYTES = 64
# Per-block shared memory a kernel may use (the opt-in maximum), by compute capability.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
REGISTER_FILE = 65536      # 32-bit registers per SM (sm_80, sm_90)
BLOCK_SIZE = 16            # EngineConfig.block_size's default
NUM_KV_BLOCKS = 4096
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_len: int
    qk_norm: bool = False


# stories260K (the parity tests' model), SmolLM2-135M (the default model), the bench models
# scripts/gpu_check.sh runs (make_bench_model.py: 110m, and 1b, TinyLlama's shape) and a Qwen3
# shape (head_dim 128, q/k norms, a 152k vocabulary)
MODEL_SHAPES = (
    ModelShape("stories260K", 64, 8, 4, 8, 172, 512, 512),
    ModelShape("smollm2-135m", 576, 9, 3, 64, 1536, 49152, 8192),
    ModelShape("bench-110m", 768, 12, 12, 64, 2048, 32000, 2048),
    ModelShape("bench-1b", 2048, 32, 4, 64, 5632, 32000, 2048),
    ModelShape("qwen3-0.6b", 1024, 16, 8, 128, 3072, 151936, 4096, qk_norm=True),
)
DECODE_SEQS = (1, 64)          # the most context splits, and one
PREFILLS = ((1, 16), (4, 512))      # (sequences, query tokens each)
SAMPLE_ROWS = (1, 64)
PACKED_SHAPE = MODEL_SHAPES[3]      # linear_packed over every format at the 1B's widths


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _attention_meta(num_seqs: int, query_len: int, context: int) -> AttentionMetadata:
    tokens = num_seqs * query_len
    decode = query_len == 1
    blocks = triton.cdiv(context, BLOCK_SIZE)
    return AttentionMetadata(
        num_decodes=num_seqs if decode else 0, num_prefills=0 if decode else num_seqs,
        num_decode_tokens=tokens if decode else 0, num_prefill_tokens=0 if decode else tokens,
        block_size=BLOCK_SIZE, slot_mapping=_meta((tokens,), torch.int64),
        block_tables=_meta((num_seqs, blocks), torch.int32),
        seq_lens=_meta((num_seqs,), torch.int32),
        query_start_loc=_meta((num_seqs + 1,), torch.int32),
        seq_lens_host=[context] * num_seqs, query_lens_host=[query_len] * num_seqs,
        max_seq_len=context, max_query_len=query_len)


def _layer_launches(m: ModelShape, dtype: torch.dtype, tokens: int) -> list[Launch]:
    """A decoder layer's elementwise launches for `tokens` rows: norms, rotary on slices of
    a fused qkv output, the KV write, silu_and_mul."""
    from . import activations, kv_cache, norms, rotary
    q_w, kv_w = m.heads * m.head_dim, m.kv_heads * m.head_dim
    qkv = _meta((tokens, q_w + 2 * kv_w), dtype)
    x, weight = _meta((tokens, m.hidden), dtype), _meta((m.hidden,), dtype)
    out = norms.rms_norm_launches(x, None, weight, 1e-5)[2]
    out += norms.rms_norm_launches(x, x.clone(), weight, 1e-5)[2]
    if m.qk_norm:
        heads = _meta((tokens, m.heads, m.head_dim), dtype)
        out += norms.rms_norm_launches(heads, None, _meta((m.head_dim,), dtype), 1e-6)[2]
    q, k, v = qkv[:, :q_w], qkv[:, q_w:q_w + kv_w], qkv[:, q_w + kv_w:]
    q_rot, k_rot, launches = rotary.rotary_launches(
        _meta((tokens,), torch.int64), q, k, _meta((m.max_len, m.head_dim), torch.float32),
        m.head_dim)
    out += launches
    cache = _meta((2, NUM_KV_BLOCKS, m.kv_heads, BLOCK_SIZE, m.head_dim), dtype)
    out += kv_cache.write_kv_cache_launches(k_rot, v, cache, _meta((tokens,), torch.int64))
    out += activations.silu_and_mul_launches(_meta((tokens, 2 * m.intermediate), dtype))[1]
    return out


def _attention_launches(m: ModelShape, dtype: torch.dtype) -> list[tuple[str, Launch]]:
    from . import attention
    cache = _meta((2, NUM_KV_BLOCKS, m.kv_heads, BLOCK_SIZE, m.head_dim), dtype)
    scale = m.head_dim ** -0.5
    out = []
    for seqs in DECODE_SEQS:
        q = _meta((seqs, m.heads * m.head_dim), dtype)
        _, launches = attention.decode_launches(q, cache, _attention_meta(seqs, 1, m.max_len),
                                                scale)
        out += [(f"decode {seqs} seqs", launch) for launch in launches]
    for seqs, q_len in PREFILLS:
        q = _meta((seqs * q_len, m.heads * m.head_dim), dtype)
        _, launches = attention.prefill_launches(q, cache, _attention_meta(seqs, q_len, q_len),
                                                 scale)
        out += [(f"prefill {seqs}x{q_len}", launch) for launch in launches]
    return out


def _sampling_launches(m: ModelShape, dtype: torch.dtype) -> list[tuple[str, Launch]]:
    from . import sampling, token_bitmask
    out = []
    for n in SAMPLE_ROWS:
        f32 = _meta((n,), torch.float32)
        for logits_dtype in sorted({torch.float32, dtype}, key=str):
            _, launches = sampling.sample_tokens_launches(
                _meta((n, m.vocab), logits_dtype), f32, _meta((n,), torch.int64), f32, f32,
                _meta((n, m.vocab), torch.float32))
            out += [(f"sample {n} rows {_SHORT[logits_dtype]}", launch) for launch in launches]
        out += [(f"bitmask {n} rows", launch) for launch in
                token_bitmask.apply_token_bitmask_launches(
                    _meta((n, m.vocab), torch.float32),
                    _meta((n, triton.cdiv(m.vocab, 32)), torch.int32))]
    return out


def _packed_launches(dtype: torch.dtype) -> list[tuple[str, Launch]]:
    from . import packed_linear
    m = PACKED_SHAPE
    out = []
    for fmt in PACKED_FORMATS.values():
        weight = PackedWeight(_meta((m.intermediate, row_bytes(fmt, m.hidden)), torch.uint8),
                              fmt, m.hidden, dtype)
        for rows in (1, 64):
            _, launches = packed_linear.linear_packed_launches(_meta((rows, m.hidden), dtype),
                                                               weight)
            out += [(f"linear_packed {fmt.name} {rows} rows", launch) for launch in launches]
    return out


# a mixture-of-experts layer of Qwen3-30B-A3B's shape: hidden, expert features, experts, top-k
MOE_SHAPE = (2048, 768, 128, 8)


def _moe_launches(dtype: torch.dtype) -> list[tuple[str, Launch]]:
    from . import moe
    hidden, inter, experts, top_k = MOE_SHAPE
    w13 = _meta((experts * 2 * inter, hidden), dtype)
    w2 = _meta((experts * hidden, inter), dtype)
    out = []
    for tokens in (1, 2048):
        _, launches = moe.fused_moe_launches(
            _meta((tokens, hidden), dtype), w13, w2, _meta((tokens, top_k), torch.float32),
            _meta((tokens, top_k), torch.int64))
        out += [(f"fused_moe {tokens} tokens", launch) for launch in launches]
    return out


def engine_launches() -> list[tuple[str, Launch]]:
    """(case label, launch) for every model shape, dtype and batch shape above."""
    out = []
    for dtype in DTYPES:
        for m in MODEL_SHAPES:
            tag = f"{m.name} {_SHORT[dtype]}"
            for tokens in (1, 2048):
                out += [(f"{tag} layer {tokens} tokens", launch)
                        for launch in _layer_launches(m, dtype, tokens)]
            out += [(f"{tag} {label}", launch) for label, launch in _attention_launches(m, dtype)]
            out += [(f"{tag} {label}", launch) for label, launch in _sampling_launches(m, dtype)]
        out += [(f"{_SHORT[dtype]} {label}", launch) for label, launch in _packed_launches(dtype)]
        out += [(f"{_SHORT[dtype]} {label}", launch) for label, launch in _moe_launches(dtype)]
        out += [(f"{_SHORT[dtype]} {label}", launch) for label, launch in _lora_launches(dtype)]
    return out


# LoRA sites of a Llama-8B layer with 8 slots of rank 64: (in, out, slots, rank) of the fused
# qkv (3 parts) and of down_proj
LORA_SHAPES = ((4096, 6144, 8, 192), (14336, 4096, 8, 64))


def _lora_launches(dtype: torch.dtype) -> list[tuple[str, Launch]]:
    from . import lora
    out = []
    for k, n, slots, rank in LORA_SHAPES:
        for tokens in (1, 2048):
            _, launches = lora.lora_add_launches(
                _meta((tokens, k), dtype), _meta((tokens, n), dtype),
                _meta((slots, rank, k), dtype), _meta((slots, rank, n), dtype),
                _meta((tokens,), torch.int64))
            out += [(f"lora_add {k}->{n} {tokens} tokens", launch) for launch in launches]
    return out


class _TargetDriver:
    """What JITFunction.warmup asks of the active driver: the target, a device id (one per
    target, so each target has its own binder cache) and a stream; nothing launches."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 1000 + self.target.arch

    def get_current_stream(self, device=None) -> int:
        return 0


@dataclass
class KernelReport:
    """One compiled kernel on one target, and the cases that launch it."""
    kernel: str
    arch: int
    constexprs: str
    num_warps: int
    registers: int = 0
    shared: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    error: str = ""
    cases: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Why this kernel fails the check ([] when it passes)."""
        if self.error:
            return [f"does not compile: {self.error}"]
        out = []
        if self.spill_stores > MAX_SPILL_BYTES:
            out.append(f"spills {self.spill_stores} bytes > {MAX_SPILL_BYTES}")
        limit = SHARED_LIMIT.get(self.arch)
        if limit is not None and self.shared > limit:
            out.append(f"shared memory {self.shared} > {limit}")
        if self.registers * 32 * self.num_warps > REGISTER_FILE:
            out.append(f"{self.registers} registers x {32 * self.num_warps} threads > "
                       f"{REGISTER_FILE}")
        return out


_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _constexprs(launch: Launch) -> str:
    return " ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in launch.kwargs.items()
                    if k not in ("num_warps", "num_stages"))


def compile_report(launch: Launch, target: GPUTarget, seen: dict[str, KernelReport]
                   ) -> KernelReport:
    """Compiles `launch` for `target` (no GPU) and returns its report; `seen` maps compiled
    kernels' hashes to reports, so a launch that compiles to a kernel already seen returns
    that kernel's report."""
    from triton import knobs

    report = KernelReport(launch.kernel.__name__, target.arch, _constexprs(launch),
                          launch.kwargs.get("num_warps", 4))
    log = io.StringIO()
    # the log is ptxas' own, so every kernel is compiled (no on-disk cache hit)
    previous = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    knobs.nvidia.dump_ptxas_log = knobs.compilation.always_compile = True
    try:
        with _targeting(target), contextlib.redirect_stdout(log):
            compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
    except Exception as e:   # a compile error of any stage is the finding, not a crash
        lines = str(e).strip().splitlines() or [""]
        report.error = f"{type(e).__name__}: {lines[0][:300]}"
        return report
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = previous
    key = compiled.hash
    if key in seen:
        return seen[key]
    text = log.getvalue()
    regs, spills = _REGS.search(text), _SPILLS.search(text)
    if regs is None or spills is None:
        report.error = f"no ptxas -v log for this kernel: {text[-300:]!r}"
        return report
    report.registers = int(regs.group(1))
    report.stack, report.spill_stores, report.spill_loads = map(int, spills.groups())
    smem = _SMEM.search(text)
    report.shared = compiled.metadata.shared + (int(smem.group(1)) if smem else 0)
    seen[key] = report
    return report


@contextlib.contextmanager
def _targeting(target: GPUTarget):
    """Triton's active driver is the target's stand-in inside, what it was after."""
    from triton.runtime.driver import driver
    before = driver._active   # None until something asked for the machine's driver
    driver.set_active(_TargetDriver(target))
    try:
        yield
    finally:
        driver.set_active(before)


def check(archs: tuple[int, ...]) -> list[KernelReport]:
    """One report per distinct compiled kernel and target, each listing its cases."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the AOT check needs TRITON_INTERPRET=0: with 1 the kernels are "
                           "interpreted and nothing compiles")
    launches = engine_launches()
    reports: list[KernelReport] = []
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        seen: dict[str, KernelReport] = {}
        for label, launch in launches:
            report = compile_report(launch, target, seen)
            if not report.cases:
                reports.append(report)
            report.cases.append(label)
    return reports


def format_table(reports: list[KernelReport]) -> str:
    head = (f"{'kernel':<26} {'sm':>3} {'warps':>5} {'regs':>4} {'smem B':>7} {'spill st/ld B':>14}"
            f" {'stack B':>7} {'cases':>5}  first case / constexprs")
    lines = [head, "-" * len(head)]
    for r in reports:
        spill = f"{r.spill_stores}/{r.spill_loads}"
        lines.append(f"{r.kernel:<26} {r.arch:>3} {r.num_warps:>5} {r.registers:>4} "
                     f"{r.shared:>7} {spill:>14} {r.stack:>7} {len(r.cases):>5}  "
                     f"{r.cases[0]} / {r.constexprs}")
        for p in r.problems():
            lines.append(f"  !! {p}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="90,80",
                        help="compute capabilities, comma-separated (default 90,80)")
    parser.add_argument("--json", action="store_true", help="one JSON line per kernel")
    args = parser.parse_args(argv)
    reports = check(tuple(int(a) for a in args.arch.split(",")))
    print(f"triton {triton.__version__}, {len(reports)} compiled kernels")
    print(format_table(reports))
    if args.json:
        for r in reports:
            print(json.dumps(asdict(r) | {"problems": r.problems()}))
    failed = [r for r in reports if r.problems()]
    print(f"{len(failed)} of {len(reports)} kernels fail the check")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
