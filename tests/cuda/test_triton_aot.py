"""Every Triton launch the engine makes, compiled ahead of time for sm_90 and sm_80 with no GPU
(`tessellm_cuda.triton_ops.aot`: the plugin's own host functions build each launch from meta
tensors; Triton compiles it, ptxas reports registers, shared memory and spills), with the
Triton in .venv and with Triton 3.6, the one a CUDA 13 torch 2.11 image ships (scripts/setup.sh
installs it alone into .venv/triton36; it shadows .venv's Triton through PYTHONPATH).

The interpreter runs the kernels' Python; only a compiler rejects too much shared memory, a
register file overrun or an unsupported dtype, and only ptxas shows a tile that spills."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TRITON36 = ROOT / ".venv" / "triton36"
ARCHS = (90, 80)


def _compile_all(arch: int, pythonpath: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(cache),
               TRITON_DEFAULT_FP_FUSION="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "tessellm_cuda.triton_ops.aot", "--arch",
                           str(arch)], capture_output=True, text=True, env=env, timeout=1500)


@pytest.mark.slow
@pytest.mark.parametrize("toolchain", ["venv", "triton-3.6"])
def test_every_engine_launch_compiles_for_sm90_and_sm80(toolchain: str, tmp_path) -> None:
    """Fails on a compile error, spills above aot.MAX_SPILL_BYTES, shared memory above the
    target's limit or registers x threads above the register file; prints the table."""
    pythonpath = ""
    if toolchain == "triton-3.6":
        if not (TRITON36 / "triton").is_dir():
            pytest.skip(f"Triton 3.6 is not installed in {TRITON36} (scripts/setup.sh does)")
        pythonpath = str(TRITON36)
        bin_dir = TRITON36 / "triton" / "backends" / "nvidia" / "bin"
    else:
        import triton
        bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not any(bin_dir.glob("ptxas*")):
        pytest.skip(f"this Triton has no bundled ptxas ({bin_dir})")
    with ThreadPoolExecutor(len(ARCHS)) as pool:   # one compiler process per target
        procs = list(pool.map(lambda a: _compile_all(a, pythonpath, tmp_path / f"sm{a}"),
                              ARCHS))
    failed = []
    for arch, proc in zip(ARCHS, procs):
        print(f"--- sm_{arch} ({toolchain}) ---\n{proc.stdout}")
        if proc.returncode != 0:
            failed.append(f"sm_{arch}: rc {proc.returncode}\n"
                          + "\n".join(line for line in proc.stdout.splitlines()
                                      if "!!" in line or "fail the check" in line)[-3000:]
                          + proc.stderr[-2000:])
    assert not failed, "\n".join(failed)


MOE_KERNELS = ("_count_kernel", "_offsets_kernel", "_scatter_kernel", "_gate_up_kernel",
               "_down_kernel", "_sum_kernel")


def test_launches_are_built_without_running_them() -> None:
    """The sweep's launches come from the host functions on meta tensors (nothing allocated,
    nothing run), cover every Triton kernel of the plugin, and float32 prefill takes 16-row
    query tiles (64 rows spill kilobytes per thread on sm_80 / sm_90)."""
    from tessellm_cuda.triton_ops import aot, attention
    launches = aot.engine_launches()
    names = {launch.kernel.__name__ for _, launch in launches}
    assert names == {"_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel",
                     "_write_kv_kernel", "_rms_norm_kernel", "_rotary_kernel",
                     "_silu_and_mul_kernel", "_sample_kernel", "_apply_token_bitmask_kernel",
                     "_gemv_kernel", "_gemm_kernel", *MOE_KERNELS, "_lora_shrink_kernel",
                     "_lora_expand_kernel"}
    assert all(a.device.type == "meta" for _, launch in launches for a in launch.args
               if isinstance(a, torch.Tensor))
    for head_dim in (8, 64, 128, 256):
        assert attention.prefill_tiles(head_dim, torch.float32, 512)[0] == 16
        assert attention.prefill_tiles(head_dim, torch.bfloat16, 512)[0] >= 32
