"""Makes docs_paths (next to this file) importable, and a fixture that puts the examples'
source directories on sys.path for one test."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture()
def on_sys_path():
    """Puts directories on sys.path for one test (and drops the modules imported from them)."""
    added: list[str] = []
    before = set(sys.modules)

    def add(path: Path) -> None:
        sys.path.insert(0, str(path))
        added.append(str(path))

    yield add
    for path in added:
        sys.path.remove(path)
    for name in set(sys.modules) - before:
        module = sys.modules[name]
        origin = getattr(module, "__file__", None) or ""
        if any(origin.startswith(p) for p in added):
            del sys.modules[name]
