"""`mkdocs build --strict` passes, and the built pages carry the included example code and the
generated references (so what readers see is what the tests run)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from docs_paths import EXAMPLES, REPO


def test_the_site_builds_strictly(tmp_path) -> None:
    site = tmp_path / "site"
    mkdocs = Path(sys.executable).with_name("mkdocs")
    run = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(site)], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    device_page = (site / "tutorials" / "device_plugin" / "index.html").read_text()
    assert "CopyWorker" in device_page and "hostchip" in device_page
    assert "--8&lt;--" not in device_page and "--8<--" not in device_page
    kernel_page = (site / "tutorials" / "faster_kernel" / "index.html").read_text()
    assert "rms_norm_functional" in kernel_page
    arch_page = (site / "tutorials" / "new_architecture" / "index.html").read_text()
    assert "rotary_rows_to_halves" in arch_page and "halves_to_pairs" in arch_page
    config_page = (site / "reference" / "configuration" / "index.html").read_text()
    assert "max_num_batched_tokens" in config_page and "drain_timeout_s" in config_page
    api_page = (site / "reference" / "plugin_api" / "index.html").read_text()
    assert "is_available" in api_page and "tessellm_kernels" in api_page
    llm_page = (site / "reference" / "llm" / "index.html").read_text()
    assert "generate" in llm_page and "temperature" in llm_page
    for page in ("architecture", "tensor_parallel", "server", "offline", "quickstart"):
        assert (site / page / "index.html").is_file()
    assert (site / "examples").is_dir() and EXAMPLES.is_dir()
