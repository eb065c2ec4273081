"""The CPU plugin's C kernels fail safe.

A native kernel that cannot be built or loaded here -- an unwritable cache directory, one
owned by someone else or writable by others, no compiler, a build past its timeout, a corrupt
cached object that does not rebuild -- is not offered and `tessellm plugins` says why; the CPU
device and its other kernels stay available and an LLM still generates the reference text. A
corrupt cached object that does rebuild is replaced and the kernel offered.

Each test points TESSELLM_CACHE_DIR at a directory of its own, and every PluginManager / LLM
here is fresh, so the native libraries are built (or refused) anew under that condition.
When the suite runs as root, permission bits do not stop writes: the unwritable cases then use
a cache path under a regular file (mkdir fails) or a refused mkstemp, and the foreign-owner
cases chown for real.
"""
from __future__ import annotations

import json
import os
import stat
import time
import types
from pathlib import Path

import pytest
from tessellm_cpu import native_build
from tessellm_cpu.native_attention import SOURCE as DECODE_SOURCE
from tessellm_cpu.native_attention import NativeDecode

from tessellm.cli.main import main
from tessellm.llm import LLM
from tessellm.plugins import PluginManager
from tessellm.sampling_params import SamplingParams

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
NATIVE = ("decode_native_paged", "linear_packed_native")
# kernels that must stay offered whatever happens to the native ones
OTHERS = {"attention_decode": "decode_batched_sdpa", "attention_prefill": "prefill_per_seq_sdpa",
          "linear": "linear_aten", "linear_packed": "linear_packed_dequant_matmul",
          "rms_norm": "rms_norm_aten", "write_kv_cache": "write_kv_index_copy"}
FAST_ENGINE = {"device": "cpu", "dtype": "float32", "load_progress": False,
               "max_num_batched_tokens": 64, "max_num_seqs": 2}


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("TESSELLM_CACHE_DIR", str(d))
    return d


def _native_dir(cache_dir: Path) -> Path:
    d = cache_dir / "native"
    d.mkdir(parents=True, mode=0o700)
    return d


def _cpu_row(pm: PluginManager) -> dict:
    rows = json.loads(json.dumps(pm.report()))
    return next(d for r in rows for d in r["devices"] if d["name"] == "cpu")


def _offered(pm: PluginManager) -> dict[str, set[str]]:
    reg = pm.kernel_registry()
    return {op: {k.name for k in reg.kernels("cpu", op)} for op in reg.ops("cpu")}


def _generates_reference(stories_dir: Path, **options) -> None:
    ref = json.loads((stories_dir / "reference_greedy.json").read_text())
    llm = LLM(str(stories_dir), **{**FAST_ENGINE, **options})
    out = llm.generate([ref["prompt"]], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert ref["prompt"] + out.text == ref["text"]


def _assert_not_offered(stories_dir: Path, capsys, why: str, kernels=NATIVE,
                        **options) -> dict[str, str]:
    """The CPU device is available, `kernels` are not offered with `why` in their reason (in
    the report and in `tessellm plugins`), every other kernel is, and an LLM generates."""
    pm = PluginManager()
    assert pm.select_device("cpu").name == "cpu"
    offered = _offered(pm)
    for kernel in kernels:
        assert all(kernel not in names for names in offered.values())
    for op, name in OTHERS.items():
        assert name in offered[op]
    row = _cpu_row(pm)
    assert row["available"] and row["reason"] == ""
    reasons = row["kernels_not_offered"]
    for kernel in kernels:
        assert why in reasons[kernel], reasons
    capsys.readouterr()
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    for kernel in kernels:
        shown = text.split(f"kernel {kernel} not offered: ", 1)[1].split("\n        kernel ")[0]
        assert why in shown
    _generates_reference(stories_dir, **options)
    return reasons


# ------------------------------------------------------------------ unwritable cache

@pytest.mark.parametrize("kind", ["parent_is_a_file", "read_only_dir", "native_dir_unwritable"])
def test_unwritable_cache_dir(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              stories_dir: Path, capsys) -> None:
    policy = "profile"   # the profile cache cannot be written either: kept in memory
    if kind == "parent_is_a_file":
        blocker = tmp_path / "a_file"
        blocker.write_text("not a directory")
        monkeypatch.setenv("TESSELLM_CACHE_DIR", str(blocker / "cache"))
        why = "cannot create the native build cache"
    elif kind == "read_only_dir":
        if IS_ROOT:
            pytest.skip("root writes into a 0o555 directory (parent_is_a_file covers this)")
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        monkeypatch.setenv("TESSELLM_CACHE_DIR", str(ro))
        why = "cannot create the native build cache"
    else:  # the native dir exists and is private, but nothing can be created in it
        cache = tmp_path / "cache"
        monkeypatch.setenv("TESSELLM_CACHE_DIR", str(cache))
        native = _native_dir(cache)
        if IS_ROOT:
            def refuse(*args, **kwargs):
                raise PermissionError(13, "Permission denied", str(native))
            monkeypatch.setattr(native_build, "tempfile", types.SimpleNamespace(mkstemp=refuse))
        else:
            native.chmod(0o500)
        why = "cannot write to the native build cache"
        policy = "first"
    try:
        _assert_not_offered(stories_dir, capsys, why, kernel_selection=policy)
    finally:
        for d in (tmp_path / "ro", tmp_path / "cache" / "native"):
            if d.exists():
                d.chmod(0o700)


# ------------------------------------------------------------------ ownership

def _plant(native: Path, marker: Path) -> Path:
    """A valid shared object at the decode kernel's cache path whose constructor creates
    `marker`: loading it would show."""
    src = native.parent / "planted.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
                   "int paged_decode_f32(void) { return 0; }\n"
                   "int paged_decode_bf16(void) { return 0; }\n")
    path = native_build.library_path(DECODE_SOURCE, native_build.library_key(DECODE_SOURCE))
    proc = native_build._run([native_build._compiler(), "-shared", "-fPIC", str(src), "-o",
                              str(path)], 60)
    assert proc.returncode == 0, proc.stderr
    path.chmod(0o700)
    return path


@pytest.mark.parametrize("kind", ["foreign_dir_chown", "foreign_dir_getuid", "group_writable_dir",
                                  "world_writable_dir", "foreign_object_chown"])
def test_cache_not_private_to_this_user_is_refused(kind: str, cache_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  stories_dir: Path, capsys) -> None:
    native = _native_dir(cache_dir)
    marker = cache_dir / "planted_code_ran"
    planted = _plant(native, marker)
    if kind == "foreign_dir_chown":
        if not IS_ROOT:
            pytest.skip("only root can chown (foreign_dir_getuid covers this)")
        os.chown(native, 4242, -1)
        why = "is owned by uid 4242, not by this user"
    elif kind == "foreign_dir_getuid":
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 4242)
        why = f"is owned by uid {real}, not by this user (uid {real + 4242})"
    elif kind == "group_writable_dir":
        native.chmod(0o770)
        why = "writable by group or others (mode 0770)"
    elif kind == "world_writable_dir":
        native.chmod(0o707)
        why = "writable by group or others (mode 0707)"
    else:
        if not IS_ROOT:
            pytest.skip("only root can chown")
        os.chown(planted, 4242, -1)
        why = f"cached native object {planted} is owned by uid 4242"
    reasons = _assert_not_offered(stories_dir, capsys, why, kernels=("decode_native_paged",),
                                  kernel_selection="first")
    assert "refusing to load native code someone else could have planted" in \
        reasons["decode_native_paged"]
    assert not marker.exists(), "a refused object was loaded"
    assert planted.exists()    # refused, not deleted: it is not ours to delete


def test_new_cache_dir_is_private(cache_dir: Path) -> None:
    old = os.umask(0o002)     # a umask that would make a plain mkdir group-writable
    try:
        native = native_build.build_library(DECODE_SOURCE).path.parent
    finally:
        os.umask(old)
    st = os.stat(native)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert not os.stat(native_build.library_path(
        DECODE_SOURCE, native_build.library_key(DECODE_SOURCE))).st_mode & 0o022


# ------------------------------------------------------------------ compiler

@pytest.mark.parametrize("kind", ["cc_missing", "none_on_path"])
def test_no_compiler(kind: str, cache_dir: Path, tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch, stories_dir: Path, capsys) -> None:
    if kind == "cc_missing":
        monkeypatch.setenv("CC", "/nonexistent/cc")
        why = "cannot run the C compiler '/nonexistent/cc'"
    else:
        monkeypatch.delenv("CC", raising=False)
        empty = tmp_path / "empty_bin"
        empty.mkdir()
        monkeypatch.setenv("PATH", str(empty))
        why = "no C compiler found"
    _assert_not_offered(stories_dir, capsys, why, kernel_selection="first")


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n"
                    'case "$1" in --version) echo "fakecc 1.0"; exit 0;; esac\n' + body)
    path.chmod(0o755)
    return path


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def test_build_timeout_kills_the_compiler(cache_dir: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, stories_dir: Path,
                                          capsys) -> None:
    pids = tmp_path / "pids"
    # the "compiler" leaves a child behind, as a real driver does (cc1, as, ld)
    cc = _script(tmp_path / "slowcc", f'sleep 60 &\necho $! >> "{pids}"\nwait\n')
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(native_build, "BUILD_TIMEOUT_S", 0.3)
    t0 = time.monotonic()
    _assert_not_offered(stories_dir, capsys, "took longer than 0.3 s (killed)",
                        kernel_selection="first")
    assert time.monotonic() - t0 < 30
    children = [int(p) for p in pids.read_text().split()]
    assert children
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in children), "the compiler's children outlived the timeout"
    assert not list((cache_dir / "native").glob("*.tmp.so"))   # no temporary file left


def test_failed_compile_is_reported(cache_dir: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch, stories_dir: Path,
                                    capsys) -> None:
    cc = _script(tmp_path / "badcc", 'echo "error: this compiler refuses" >&2\nexit 3\n')
    monkeypatch.setenv("CC", str(cc))
    _assert_not_offered(stories_dir, capsys, "this compiler refuses", kernel_selection="first")
    assert not list((cache_dir / "native").glob("*.so"))


# ------------------------------------------------------------------ corrupt objects

def test_corrupt_cached_object_is_rebuilt(cache_dir: Path, stories_dir: Path) -> None:
    _native_dir(cache_dir)
    path = native_build.library_path(DECODE_SOURCE, native_build.library_key(DECODE_SOURCE))
    garbage = b"\x7fELF\x02\x01\x01" + b"\0" * 9 + b"truncated"
    path.write_bytes(garbage)
    path.chmod(0o700)
    pm = PluginManager()
    offered = _offered(pm)
    assert "decode_native_paged" in offered["attention_decode"]
    # nothing failed to build (kernels this CPU lacks the instructions for are named only
    # for that reason)
    reasons = _cpu_row(pm).get("kernels_not_offered", {})
    assert all(why.startswith("this CPU has no ") for why in reasons.values()), reasons
    assert path.read_bytes() != garbage and path.stat().st_size > 1000
    # kernel_selection "first" runs the native decode kernel (the first candidate)
    _generates_reference(stories_dir, kernel_selection="first")


def test_corrupt_object_that_does_not_rebuild_is_not_offered(
        cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stories_dir: Path,
        capsys) -> None:
    # a "compiler" whose output the loader rejects
    cc = _script(tmp_path / "junkcc", 'while [ "$1" != "-o" ]; do shift; done\n'
                                      'echo "not an ELF object" > "$2"\n')
    monkeypatch.setenv("CC", str(cc))
    native = _native_dir(cache_dir)
    path = native_build.library_path(DECODE_SOURCE, native_build.library_key(DECODE_SOURCE))
    path.write_bytes(b"corrupt")
    path.chmod(0o700)
    _assert_not_offered(stories_dir, capsys, "loading the freshly built", kernel_selection="first")
    assert not list(native.glob("*.so"))   # the unloadable objects are not kept


def test_fresh_objects_are_built_not_shared(cache_dir: Path) -> None:
    """Two NativeDecode objects over a fresh cache: the second loads what the first built."""
    first = NativeDecode()
    path = native_build.library_path(DECODE_SOURCE, first.code_hash)
    mtime = path.stat().st_mtime_ns
    second = NativeDecode()
    assert second.code_hash == first.code_hash and path.stat().st_mtime_ns == mtime


def test_concurrent_builds_in_threads_are_atomic(cache_dir: Path) -> None:
    """Threads building the same library at once: each compiles to a file of its own and
    renames it into place, so every one loads a whole object and no temporary file is left."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        built = list(pool.map(lambda _: native_build.build_library(DECODE_SOURCE), range(4)))
    assert len({b.path for b in built}) == 1
    for b in built:
        assert b.lib.paged_decode_f32_team is not None
    native = cache_dir / "native"
    assert [p.name for p in native.iterdir()] == [built[0].path.name]


def test_a_header_beside_the_source_is_part_of_the_cache_key(tmp_path) -> None:
    """Kernels include native/vec_math.h: editing it must rebuild them, not load a stale
    object."""
    src = tmp_path / "k.c"
    src.write_text('#include "m.h"\nint f(void) { return M; }\n')
    (tmp_path / "m.h").write_text("#define M 1\n")
    before = native_build.library_key(src)
    (tmp_path / "m.h").write_text("#define M 2\n")
    assert native_build.library_key(src) != before
