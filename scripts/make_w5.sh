#!/usr/bin/env bash
# Workload W5 (../shared/bench/WORKLOAD.md): the bench model's `1b` shape (TinyLlama-1.1B:
# 22 layers, d 2048, GQA 32/4, Llama 2 tokenizer, seeded random weights) as an F16 GGUF written
# by `tessellm convert`, then quantized to Q4_K_M by llama.cpp's own quantizer (ftype 15).
# Needs the project venv (.venv) and llama-cpp-python in its own venv (LCPP_PYTHON, default
# /tmp/lcpp/bin/python; ../shared/bench/WORKLOAD.md says how to build it). ~3 GB of disk.
# Usage: scripts/make_w5.sh [OUT_DIR]   -> OUT_DIR/bench1b-q4km.gguf (about 636 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-/tmp/models}"
LCPP_PYTHON="${LCPP_PYTHON:-/tmp/lcpp/bin/python}"
mkdir -p "$OUT"
[ -f "$OUT/bench1b/config.json" ] || \
  .venv/bin/python ../shared/bench/make_bench_model.py "$OUT/bench1b" --shape 1b
.venv/bin/tessellm convert "$OUT/bench1b" "$OUT/bench1b-f16.gguf"
"$LCPP_PYTHON" - "$OUT/bench1b-f16.gguf" "$OUT/bench1b-q4km.gguf" <<'PY'
import sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = 15   # LLAMA_FTYPE_MOSTLY_Q4_K_M
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
PY
echo "wrote $OUT/bench1b-q4km.gguf"
