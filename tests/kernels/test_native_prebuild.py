"""A fresh native cache compiles the CPU plugin's C sources side by side (native_build.prebuild)
and `build_library` then loads them without compiling; a source that does not compile is left
for `build_library` to report, never raised by the prebuild."""
from __future__ import annotations

from pathlib import Path

import pytest
from tessellm_cpu import native_build
from tessellm_cpu.native_linear import NATIVE


def test_prebuild_compiles_every_missing_source_once(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSELLM_CACHE_DIR", str(tmp_path))
    sources = [NATIVE / "token_ops.c", NATIVE / "linear_amx.c"]
    compiled: list[str] = []
    real = native_build._compile
    monkeypatch.setattr(native_build, "_compile",
                        lambda cc, src, *a: (compiled.append(src.name), real(cc, src, *a))[1])
    native_build.prebuild(sources)
    assert sorted(compiled) == ["linear_amx.c", "token_ops.c"]
    for s in sources:
        assert native_build.library_path(s, native_build.library_key(s)).exists()
    compiled.clear()
    lib = native_build.build_library(NATIVE / "token_ops.c")
    assert compiled == [] and lib.path.exists()
    native_build.prebuild(sources)   # all cached: nothing compiles
    assert compiled == []


def test_a_source_that_does_not_compile_is_left_to_build_library(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSELLM_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.c"
    bad.write_text("this is not C\n")
    good = tmp_path / "good.c"
    good.write_text("int answer(void) { return 42; }\n")
    native_build.prebuild([bad, good])   # no exception
    assert native_build.build_library(good).lib.answer() == 42
    with pytest.raises(native_build.NativeBuildError, match="broken.c"):
        native_build.build_library(bad)
