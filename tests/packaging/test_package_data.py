"""The CPU plugin's wheel ships every file its native kernels include.

The wheel's contents come from `[tool.setuptools.package-data]` in pyproject.toml; a header a C
source includes but no glob matches is missing from an installed (non-editable) tessellm, where
every native kernel then fails to build. This reads the globs the way setuptools does (relative
to the package directory) and follows each quoted `#include` from every shipped source.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "tessellm_cpu"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _package_dir(pyproject: dict, package: str) -> Path:
    """Where setuptools finds `package`: the first `where` root of packages.find holding it."""
    roots = pyproject["tool"]["setuptools"]["packages"]["find"].get("where", ["."])
    for root in roots:
        candidate = ROOT / root / package.replace(".", "/")
        if (candidate / "__init__.py").is_file():
            return candidate
    raise AssertionError(f"package {package} not found under {roots}")


def _shipped(pyproject: dict, package: str) -> tuple[Path, set[Path]]:
    """The package directory and the data files its package-data globs select."""
    base = _package_dir(pyproject, package)
    globs = pyproject["tool"]["setuptools"].get("package-data", {}).get(package, [])
    return base, {p.resolve() for g in globs for p in base.glob(g) if p.is_file()}


def _unshipped_includes(base: Path, shipped: set[Path]) -> list[str]:
    """`file: #include "x"` for every quoted include of a shipped C source or header that
    does not resolve (relative to the including file) to a shipped file."""
    missing = []
    for source in sorted(p for p in shipped if p.suffix in (".c", ".h")):
        for name in INCLUDE.findall(source.read_text(encoding="utf-8")):
            target = (source.parent / name).resolve()
            if target not in shipped:
                state = "not matched by package-data" if target.is_file() else "no such file"
                missing.append(f"{source.relative_to(base)}: #include \"{name}\" ({state})")
    return missing


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_every_quoted_include_of_the_native_sources_is_shipped() -> None:
    base, shipped = _shipped(_pyproject(), PACKAGE)
    sources = sorted((base / "native").glob("*.c"))
    assert sources, f"no native C sources under {base / 'native'}"
    unshipped_sources = [str(s.relative_to(base)) for s in sources if s.resolve() not in shipped]
    assert not unshipped_sources, f"native sources not in package-data: {unshipped_sources}"
    assert not _unshipped_includes(base, shipped), "\n".join(_unshipped_includes(base, shipped))


def test_the_check_catches_a_header_left_out_of_package_data() -> None:
    pyproject = _pyproject()
    pyproject["tool"]["setuptools"]["package-data"][PACKAGE] = ["native/*.c"]
    base, shipped = _shipped(pyproject, PACKAGE)
    missing = _unshipped_includes(base, shipped)
    assert any('#include "vec_math.h" (not matched by package-data)' in m for m in missing)
