"""Build (once) and load the CPU plugin's C kernels with the machine's C compiler.

The shared library is compiled for this CPU (-march=native) with OpenMP; it links the same
libgomp soname torch loaded, so both share one OpenMP runtime and thread count. Builds are
cached under <cache root>/native/, keyed by a hash of the source, the flags, the compiler's
version and the CPU's feature flags; a build is written to a temporary name and renamed, so
concurrent processes never load a half-written file. A failed build raises NativeBuildError
with the compiler's output: the caller decides what that means (the kernel is not offered).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from tessellm.plugin_api import cache_root

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]


class NativeBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded here."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeBuildError("no C compiler found (set CC, or install gcc)")
    return cc


def build_library(source: Path) -> ctypes.CDLL:
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeBuildError(f"cannot run the C compiler {cc!r}: {e}") from e
    text = source.read_text()
    key = hashlib.sha256("\n".join([text, " ".join(FLAGS), version, _cpu_flags()]).encode())
    out_dir = cache_root() / "native"
    lib_path = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not lib_path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = lib_path.with_suffix(f".tmp{os.getpid()}.so")
        proc = subprocess.run([cc, *FLAGS, str(source), "-o", str(tmp), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise NativeBuildError(f"compiling {source.name} failed:\n{proc.stderr.strip()}")
        tmp.replace(lib_path)
    try:
        return ctypes.CDLL(str(lib_path))
    except OSError as e:
        raise NativeBuildError(f"loading {lib_path} failed: {e}") from e
