"""The device plugin tutorial's package (docs/examples/device_plugin) installs from its own
pyproject.toml and passes `tessellm conformance`, printing the line the tutorial quotes."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

from docs_paths import DOCS, EXAMPLES
from tessellm.plugin_spec import ENTRY_POINT_GROUP
from tessellm.plugins import PluginManager
from tessellm.testing import run_conformance

PACKAGE = EXAMPLES / "device_plugin"


def test_the_kit_passes_the_tutorial_device_in_process(on_sys_path, stories_dir) -> None:
    on_sys_path(PACKAGE / "src")
    ep = importlib.metadata.EntryPoint(name="hostchip", value="tessellm_hostchip.plugin",
                                       group=ENTRY_POINT_GROUP)
    report = run_conformance("hostchip", PluginManager([ep]).load(), stories_dir)
    assert report.passed, report.table()
    checks = {r.check for r in report.results}
    assert {"stream.copy_event", "stream.synchronize", "allocator.capacity",
            "kernel:attention_decode/hostchip_attention_decode",
            "end_to_end.demo", "end_to_end.stories260K"} <= checks


def test_installed_from_its_pyproject_it_passes_the_cli(tmp_path) -> None:
    target = tmp_path / "site-packages"
    build = tmp_path / "src"
    subprocess.run(["cp", "-r", str(PACKAGE), str(build)], check=True)  # builds leave files
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-build-isolation", "--target", str(target), str(build)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(target), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("TESSELLM_CONFORMANCE_MODEL", None)   # the kit alone: no model named
    run = subprocess.run([sys.executable, "-m", "tessellm.cli.main", "conformance", "--device",
                          "hostchip"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("device 'hostchip' conformance PASSED")
    assert f"    {last}\n" in (DOCS / "tutorials" / "device_plugin.md").read_text(), \
        f"the tutorial quotes another verdict than the kit prints: {last!r}"
