"""Build (once) and load the CPU plugin's C kernels with the machine's C compiler.

The shared library is compiled for this CPU (-march=native) with OpenMP; it links the same
libgomp soname torch loaded, so both share one OpenMP runtime and thread count. Builds are
cached under <cache root>/native/, keyed by a hash of the source, the flags, the compiler's
version and the CPU's feature flags.

Fail-safe rules (every failure is a NativeBuildError saying why; the caller decides what that
means -- the CPU plugin does not offer the kernel and reports the reason):
- no compiler, a compiler that cannot run, a failed compile, a compile past BUILD_TIMEOUT_S
  (the compiler's whole process group is killed);
- a cache directory that cannot be created or written;
- a cache directory, or a cached object, not owned by this user or writable by group or
  others: never loaded, since someone else could have planted it (the directory is created
  with mode 0o700);
- a cached object the loader rejects (truncated, corrupt): deleted and rebuilt once; if the
  rebuilt one is rejected too, the build fails.
A build compiles to a temporary file unique to the process and thread (mkstemp in the cache
directory) and is renamed into place (os.replace), so concurrent builders never load a
half-written file.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from tessellm.plugin_api import cache_root

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
BUILD_TIMEOUT_S = 300.0     # one compile; past it the compiler is killed
VERSION_TIMEOUT_S = 30.0    # `cc --version`


class NativeBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded here."""


@dataclass(frozen=True)
class NativeLibrary:
    """A loaded library and the hash it is cached under (source, flags, compiler, CPU)."""

    lib: ctypes.CDLL
    key: str
    path: Path


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def host_cpu_flags() -> frozenset[str]:
    """The feature flags /proc/cpuinfo lists for this CPU (empty where it lists none)."""
    line = _cpu_flags()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeBuildError("no C compiler found (set CC, or install gcc)")
    return cc


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run `cmd` in its own process group; on timeout kill the whole group (a compiler
    driver's cc1/as/ld children too) and raise subprocess.TimeoutExpired."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.communicate()
        raise
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _private(path: Path, what: str) -> None:
    """Refuse `path` unless this user owns it and neither group nor others may write it."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise NativeBuildError(f"cannot stat the {what} {path}: {e}") from e
    if not hasattr(os, "getuid"):
        return
    uid = os.getuid()
    if st.st_uid != uid:
        raise NativeBuildError(
            f"the {what} {path} is owned by uid {st.st_uid}, not by this user (uid {uid}): "
            "refusing to load native code someone else could have planted (remove it: the "
            "kernels are rebuilt in a directory of mode 0700)")
    if st.st_mode & 0o022:
        raise NativeBuildError(
            f"the {what} {path} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): refusing to load native code someone else "
            "could have planted (remove it: the kernels are rebuilt in a directory of mode 0700)")


def _cache_dir() -> Path:
    out_dir = cache_root() / "native"
    try:
        out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise NativeBuildError(f"cannot create the native build cache {out_dir}: "
                               f"{type(e).__name__}: {e}") from e
    if not out_dir.is_dir():
        raise NativeBuildError(f"the native build cache {out_dir} is not a directory")
    _private(out_dir, "native build cache directory")
    return out_dir


def library_key(source: Path, cc: str | None = None) -> str:
    """The hash a build of `source` is cached under: source text and the headers of its
    directory, flags, compiler version, CPU feature flags."""
    cc = cc or _compiler()
    try:
        version = _run([cc, "--version"], VERSION_TIMEOUT_S).stdout
    except subprocess.TimeoutExpired as e:
        raise NativeBuildError(f"the C compiler {cc!r} did not answer --version within "
                               f"{VERSION_TIMEOUT_S:g} s") from e
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeBuildError(f"cannot run the C compiler {cc!r}: {e}") from e
    try:   # the source, the headers beside it (a source may include any of them) and the
        # sources it includes whole (`#include "linear_packed.c"`)
        own = source.read_text()
        whole = sorted(set(re.findall(r'^#include "([\w.]+\.c)"', own, re.MULTILINE)))
        text = "\n".join([own] + [(source.parent / c).read_text() for c in whole]
                         + [h.read_text() for h in sorted(source.parent.glob("*.h"))])
    except OSError as e:
        raise NativeBuildError(f"cannot read the kernel source {source}: {e}") from e
    data = "\n".join([text, " ".join(FLAGS), version, _cpu_flags()]).encode()
    return hashlib.sha256(data).hexdigest()


def _compile(cc: str, source: Path, out_dir: Path, lib_path: Path) -> None:
    try:
        fd, tmp_name = tempfile.mkstemp(
            prefix=f"{lib_path.stem}.{os.getpid()}-{threading.get_ident()}.", suffix=".tmp.so",
            dir=out_dir)
        os.close(fd)
    except OSError as e:
        raise NativeBuildError(f"cannot write to the native build cache {out_dir}: "
                               f"{type(e).__name__}: {e}") from e
    tmp = Path(tmp_name)
    try:
        try:
            proc = _run([cc, *FLAGS, str(source), "-o", str(tmp), "-lm"], BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise NativeBuildError(f"compiling {source.name} took longer than "
                                   f"{BUILD_TIMEOUT_S:g} s (killed)") from e
        except (OSError, subprocess.SubprocessError) as e:
            raise NativeBuildError(f"cannot run the C compiler {cc!r}: {e}") from e
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            shown = "\n".join((["..."] if len(lines) > 40 else []) + lines[-40:])
            raise NativeBuildError(f"compiling {source.name} with {cc!r} failed "
                                   f"(exit {proc.returncode}):\n{shown}")
        try:
            os.chmod(tmp, 0o700)
            os.replace(tmp, lib_path)
        except OSError as e:
            raise NativeBuildError(f"cannot store the built {lib_path.name} in {out_dir}: "
                                   f"{type(e).__name__}: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> ctypes.CDLL:
    _private(path, "cached native object")
    return ctypes.CDLL(str(path))


def library_path(source: Path, key: str) -> Path:
    """Where the build of `source` with hash `key` is cached."""
    return cache_root() / "native" / f"{source.stem}-{key[:16]}.so"


def prebuild(sources: list[Path]) -> None:
    """Compile the sources whose build is not cached yet, one compiler process per core at
    once, so a fresh cache costs the longest compile rather than the sum. A failure is left
    for `build_library`, which reports it when that source's kernel is built."""
    try:
        cc = _compiler()
        out_dir = _cache_dir()
        missing = [(s, library_path(s, library_key(s, cc))) for s in sources]
    except NativeBuildError:
        return
    missing = [(s, p) for s, p in missing if not p.exists()]
    if len(missing) < 2:
        return

    def compile_one(item: tuple[Path, Path]) -> None:
        try:
            _compile(cc, item[0], out_dir, item[1])
        except NativeBuildError:
            pass
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        list(pool.map(compile_one, missing))


def build_library(source: Path) -> NativeLibrary:
    """The library built from `source` for this machine: from the cache, else compiled now."""
    cc = _compiler()
    key = library_key(source, cc)
    out_dir = _cache_dir()
    lib_path = library_path(source, key)
    if lib_path.exists():
        try:
            return NativeLibrary(_load(lib_path), key, lib_path)
        except OSError:
            # the loader rejects it (truncated, corrupt): delete it, rebuild once below
            try:
                lib_path.unlink(missing_ok=True)
            except OSError as e:
                raise NativeBuildError(f"the cached {lib_path} cannot be loaded and cannot "
                                       f"be deleted: {e}") from e
    _compile(cc, source, out_dir, lib_path)
    try:
        return NativeLibrary(_load(lib_path), key, lib_path)
    except OSError as e:
        lib_path.unlink(missing_ok=True)
        raise NativeBuildError(f"loading the freshly built {lib_path} failed: {e}") from e


def entry_point(native: NativeLibrary, name: str) -> ctypes._CFuncPtr:
    """The exported function `name`, or a NativeBuildError if the library lacks it."""
    try:
        return getattr(native.lib, name)
    except AttributeError as e:
        raise NativeBuildError(f"{native.path} has no symbol {name!r}") from e


def entry_points_by_dtype(native: NativeLibrary, stem: str, argtypes: list
                          ) -> dict[torch.dtype, ctypes._CFuncPtr]:
    """The float32 and bfloat16 entry points `<stem>_f32` and `<stem>_bf16` (int result), by
    dtype, their argument types set."""
    fns = {}
    for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        fn = entry_point(native, f"{stem}_{suffix}")
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        fns[dtype] = fn
    return fns
