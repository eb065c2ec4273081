"""The CUDA plugin's Triton kernels on a GPU against the fp32 reference: what the interpreter
cannot show. Run by scripts/gpu_check.sh first (correctness call), on `cuda` only.

- attention (decode and prefill) in bfloat16 / float16 runs the tensor-core path (16-bit
  `tl.dot`, `wgmma` on sm_90) that the interpreter never executes (it forces the fp32 dot):
  its error against the float32 reference of the same inputs must stay within 4x the error
  of the torch reference computed in that 16-bit dtype (the output's rounding, plus the
  probabilities rounded to 16 bits for the tensor cores), and within the profiler's
  tolerance (else the profiler would reject the kernel and quietly serve torch);
- rms_norm, silu_and_mul, rotary: GPU exp / rsqrt / division are approximate (ex2.approx,
  rsqrt.approx, div.full), so where the interpreter reproduces the reference's roundings
  exactly a 16-bit result may differ by one unit in the last place (bound: 1 ulp), float32
  by a few ulps (bound: 64 ulps, below the profiler's rtol 1e-5); measured here;
- sample_tokens: rows whose token differs from the reference on the same logits and noise
  (near-ties within a few float32 ulps only; budget 1e-3 of the rows).

Prints one JSON line per figure and exits 1 when a bound is exceeded. `--quick` runs small
shapes on `--device` (e.g. cpu under TRITON_INTERPRET=1: a smoke test of this script).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from tessellm.kernels import reference
from tessellm.kernels.examples import fill_unowned_slots, make_attention_metadata
from tessellm.kernels.profiler import TOLERANCES
from tessellm_cuda.triton_ops import activations, attention, norms, rotary, sampling

DEV = "cuda"
QUICK = False
SAMPLE_MISMATCH_BUDGET = 1e-3
failures: list[str] = []


def report(check: str, ok: bool, **figures) -> None:
    print(json.dumps({"check": check, "ok": ok, **figures}), flush=True)
    if not ok:
        failures.append(check)


def attention_inputs(query_lens, seq_lens, decodes, nh, nkv, hd, gen):
    meta, num_blocks = make_attention_metadata(query_lens, seq_lens, 16, decodes, "cpu", gen)
    cache = torch.randn((2, num_blocks, nkv, 16, hd), generator=gen)
    fill_unowned_slots(cache, meta, gen)
    q = torch.randn((sum(query_lens), nh * hd), generator=gen)
    return q, cache, meta


def to_device(meta):
    from tessellm.testing.kernel_cases import attention_metadata_to
    return attention_metadata_to(meta, DEV)


def check_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    cases = {  # name: (query_lens, seq_lens, decodes)
        "decode": ([1] * 8, [1, 17, 64, 200, 513, 1000, 2047, 33], 8),
        "prefill": ([16, 512, 100], [16, 512, 700], 0),
    }
    shapes = ((64, 32, 8), (128, 16, 8))
    if QUICK:
        cases = {"decode": ([1] * 2, [5, 40], 2), "prefill": ([16, 9], [16, 30], 0)}
        shapes = ((64, 4, 2),)
    for hd, nh, nkv in shapes:
        for name, (q_lens, s_lens, decodes) in cases.items():
            q, cache, meta = attention_inputs(q_lens, s_lens, decodes, nh, nkv, hd, gen)
            dmeta = to_device(meta)
            scale = 1 / math.sqrt(hd)
            kernel = (attention.paged_attention_decode if decodes
                      else attention.paged_attention_prefill)
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                qd, cd = q.to(dt), cache.to(dt)
                # the fp32 reference of exactly these (rounded) inputs
                truth = reference.paged_attention(qd.float().to(DEV), cd.float().to(DEV),
                                                  dmeta, scale)
                got = kernel(qd.to(DEV), cd.to(DEV), dmeta, scale).float()
                ref16 = reference.paged_attention(qd.to(DEV), cd.to(DEV), dmeta, scale).float()
                err = (got - truth).abs().max().item()
                ref_err = (ref16 - truth).abs().max().item()
                rtol, atol = TOLERANCES[dt]
                within = bool(torch.allclose(got, ref16, rtol=rtol, atol=atol))
                bound = max(4 * ref_err, 1e-5)
                report(f"attention_{name}_hd{hd}_{str(dt)[6:]}", within and err <= bound,
                       max_err_vs_fp32=err, torch_same_dtype_err=ref_err,
                       within_profiler_tolerance=within,
                       path="fp32 dot" if dt == torch.float32 else "tensor cores")


def ulp_figures(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Fraction of elements that differ and the largest difference in units of the dtype's
    last place (at the reference's magnitude)."""
    diff = got.float() - ref.float()
    eps = torch.finfo(ref.dtype).eps
    ulp = ref.float().abs().clamp_min(torch.finfo(ref.dtype).tiny) * eps
    return {"differ": (diff != 0).float().mean().item(),
            "max_ulps": (diff.abs() / ulp).max().item()}


def check_elementwise() -> None:
    gen = torch.Generator().manual_seed(1)
    rows = 8 if QUICK else 512
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        max_ulps = 64 if dt == torch.float32 else 1
        x = torch.randn((rows, 2048), generator=gen).to(dt).to(DEV)
        w = torch.randn(2048, generator=gen).to(dt).to(DEV)
        f = ulp_figures(norms.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
        report(f"rms_norm_{str(dt)[6:]}", f["max_ulps"] <= max_ulps, **f)
        a = torch.randn((rows, 2 * 4096), generator=gen).to(dt).to(DEV)
        f = ulp_figures(activations.silu_and_mul(a), reference.silu_and_mul(a))
        report(f"silu_and_mul_{str(dt)[6:]}", f["max_ulps"] <= max_ulps, **f)
        q = torch.randn((rows, 32 * 64), generator=gen).to(dt).to(DEV)
        k = torch.randn((rows, 8 * 64), generator=gen).to(dt).to(DEV)
        pos = torch.randint(0, 4096, (rows,), generator=gen).to(DEV)
        inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
        ang = torch.arange(4096).float()[:, None] * inv[None, :]
        cos_sin = torch.cat([ang.cos(), ang.sin()], 1).to(DEV)
        got = rotary.rotary_embedding(pos, q, k, cos_sin, 64)
        exp = reference.rotary_embedding(pos, q, k, cos_sin, 64)
        f = ulp_figures(torch.cat([got[0], got[1]], 1), torch.cat([exp[0], exp[1]], 1))
        report(f"rotary_{str(dt)[6:]}", f["max_ulps"] <= max_ulps, **f)


def check_sampling() -> None:
    gen = torch.Generator().manual_seed(2)
    rows, vocab = (8, 1000) if QUICK else (4096, 32000)
    logits = (torch.randn((rows, vocab), generator=gen) * 3).to(DEV)
    noise = torch.empty((rows, vocab)).exponential_(generator=gen).clamp_min_(
        torch.finfo(torch.float32).tiny).to(DEV)
    temp = torch.full((rows,), 0.8, device=DEV)
    top_k = torch.tensor([vocab if i % 3 == 0 else 50 for i in range(rows)], device=DEV)
    top_p = torch.tensor([1.0 if i % 2 else 0.9 for i in range(rows)], device=DEV)
    min_p = torch.tensor([0.05 if i % 5 == 0 else 0.0 for i in range(rows)], device=DEV)
    got = sampling.sample_tokens(logits, temp, top_k, top_p, min_p, noise)
    exp = reference.sample_tokens(logits, temp, top_k, top_p, min_p, noise)
    rate = (got != exp).float().mean().item()
    report("sample_tokens", rate <= SAMPLE_MISMATCH_BUDGET, rows=rows, mismatch_rate=rate,
           budget=SAMPLE_MISMATCH_BUDGET)


def main() -> int:
    global DEV, QUICK
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    args = parser.parse_args()
    DEV, QUICK = args.device, args.quick
    if DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_accuracy: no CUDA device", file=sys.stderr)
        return 2
    for check in (check_attention, check_elementwise, check_sampling):
        try:
            check()
        except Exception as e:  # one failing check must not hide the others' figures
            report(check.__name__, False, error=f"{type(e).__name__}: {e}"[:500])
    print(json.dumps({"check": "gpu_accuracy", "failed": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
