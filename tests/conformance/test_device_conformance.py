"""Every device tessellm ships passes the conformance kit (tessellm.testing), one test per
check, run exactly as a vendor's CI runs it (the kit's own pytest hook and test function).

Devices: TESSELLM_TEST_DEVICES (default cpu,sim,triton-interpret; scripts/test.sh runs xla in
.venv-xla, scripts/gpu_check.sh cuda on a GPU machine). A device that is missing or
unavailable is a failing test naming why, never a skip.
"""
from __future__ import annotations

import os
from pathlib import Path

from tessellm.testing import pytest_generate_tests, test_conformance  # noqa: F401  (the kit)

TESSELLM_DEVICES = os.environ.get("TESSELLM_TEST_DEVICES", "cpu,sim,triton-interpret").split(",")
TESSELLM_MODEL = str(Path(os.environ.get("TESSELLM_SHARED_DIR")
                          or Path(__file__).resolve().parents[2].parent / "shared")
                     / "models" / "stories260K-hf")
