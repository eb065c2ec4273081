#!/usr/bin/env bash
# The XLA plugin's own environment: .venv-xla with torch 2.9.0 and torch-xla 2.9.0 (the newest
# torch-xla, which needs that torch exactly; PyPI has it only as its CUDA build, about 3.9 GB of
# wheels), tessellm, its XLA plugin and the test plugin, editable. It cannot share .venv
# (torch 2.13). Reused when it already imports torch_xla. Tests run there on PJRT's CPU client.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! .venv-xla/bin/python -c "import torch_xla" >/dev/null 2>&1; then
  "$PYTHON" -m venv .venv-xla
  .venv-xla/bin/python -m pip install -q --upgrade pip
  .venv-xla/bin/python -m pip install -q "torch==2.9.0" "torch-xla==2.9.0"
fi
.venv-xla/bin/python -m pip install -q -e ".[test]" "torch==2.9.0"
if [ -f plugins/xla/pyproject.toml ]; then
  .venv-xla/bin/python -m pip install -q -e plugins/xla
fi
.venv-xla/bin/python -m pip install -q -e tests/plugins/tessellm_sim
