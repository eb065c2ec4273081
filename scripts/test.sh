#!/usr/bin/env bash
# The whole test suite (what CI runs, after scripts/setup.sh and scripts/setup_xla.sh):
# 1. everything in .venv (torch 2.13, CPU; the CUDA plugin's Triton kernels through Triton's
#    interpreter), pytest arguments passed through;
# 2. the XLA plugin in .venv-xla (torch 2.9.0 + torch-xla 2.9.0) on PJRT's CPU client: its own
#    tests, the device conformance suite and the fp32 HF parity matrix on `xla`;
# 3. the documentation site, `mkdocs build --strict` (into a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q "$@"
PJRT_DEVICE=CPU TESSELLM_TEST_DEVICES=xla TESSELLM_TEST_DEVICE=xla \
  .venv-xla/bin/python -m pytest -q -p no:cacheprovider tests/xla tests/conformance \
  tests/models/test_hf_parity.py -k "not bf16"
SITE_DIR="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet -d "$SITE_DIR"
rm -rf "$SITE_DIR"
