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


@pytest.fixture()
def tutorial_plugins(on_sys_path):
    """A loaded PluginManager of the cpu plugin and one tutorial plugin of docs/examples:
    tutorial_plugins(example directory, entry-point name, its module)."""
    import importlib.metadata

    from docs_paths import EXAMPLES
    from tessellm.plugin_spec import ENTRY_POINT_GROUP
    from tessellm.plugins import PluginManager

    def load(example: str, name: str, module: str) -> PluginManager:
        on_sys_path(EXAMPLES / example / "src")
        cpu = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
               if ep.name == "cpu"]
        tutorial = importlib.metadata.EntryPoint(name=name, value=module,
                                                 group=ENTRY_POINT_GROUP)
        return PluginManager(cpu + [tutorial]).load()
    return load
