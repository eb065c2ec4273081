"""The XLA plugin's tests run in .venv-xla (scripts/setup_xla.sh: torch 2.9.0 + torch-xla 2.9.0)
on PJRT's CPU client; in the main .venv, which has no torch_xla, they are skipped with that
reason (CI runs them in .venv-xla: see .ci/run)."""
from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
