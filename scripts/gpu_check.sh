#!/usr/bin/env bash
# The CUDA plugin's checks on a GPU, in one call of the device tool (prepare first, here:
# scripts/gpu_prepare.sh), e.g.
#   run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu_assets"], timeout_s=580)
# Prints one JSON line per figure to $OUT/figures.jsonl and logs to $OUT/log.txt:
# device conformance on cuda, stories260K against its reference, the HF parity matrix
# (fp32 and bf16), the profiler's kernel table on cuda, W1 on the bench model (110m) and on the
# 1B shape with CUDA graphs on and off, and with graphs but without async scheduling.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
FIG="$OUT/figures.jsonl"
: > "$FIG"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TESSELLM_CACHE_DIR=/tmp/tessellm-cache
export TESSELLM_SHARED_DIR="$PWD/.gpu_assets"
PY=python3
exec > >(tee -a "$LOG") 2>&1

if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . -e plugins/cuda || exit 1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
$PY -m tessellm.cli.main plugins

figure() {  # name, command...: runs the command, appends {"check": name, "rc": rc, ...}
  local name="$1"; shift
  local t0=$(date +%s.%N)
  "$@" > "$OUT/$name.out" 2>&1
  local rc=$?
  local dt=$(echo "$(date +%s.%N) - $t0" | bc)
  local tail=$(tail -c 300 "$OUT/$name.out" | $PY -c 'import json,sys; print(json.dumps(sys.stdin.read()))')
  echo "{\"check\": \"$name\", \"rc\": $rc, \"seconds\": $dt, \"tail\": $tail}" | tee -a "$FIG"
}

STORIES="$TESSELLM_SHARED_DIR/models/stories260K-hf"
figure conformance env TESSELLM_TEST_DEVICES=cuda $PY -m pytest -q -x tests/conformance
figure parity env TESSELLM_TEST_DEVICE=cuda $PY -m pytest -q tests/models/test_hf_parity.py \
  -k "greedy or logits or stories260k"
figure kernels_stories $PY -m tessellm.cli.main kernels --model "$STORIES" --device cuda \
  --dtype float32 --buckets 1,16,256 --json

mkdir -p /tmp/models
$PY .gpu_assets/bench/make_bench_model.py /tmp/models/bench110m --shape 110m >/dev/null 2>&1
$PY .gpu_assets/bench/make_bench_model.py /tmp/models/bench1b --shape 1b >/dev/null 2>&1
for model in bench110m bench1b; do
  for mode in graphs eager graphs_sync; do   # graphs_sync: without async scheduling
    extra=()
    [ "$mode" = eager ] && extra=(--enforce-eager)
    [ "$mode" = graphs_sync ] && extra=(--no-async-scheduling)
    figure "w1_${model}_${mode}" $PY -m tessellm.cli.main bench throughput \
      --model "/tmp/models/$model" --device cuda --dtype bfloat16 --max-num-seqs 64 \
      --runs 3 "${extra[@]}"
    grep -h '^{' "$OUT/w1_${model}_${mode}.out" | tail -1 | \
      $PY -c "import json,sys; d=json.load(sys.stdin); d['check']='w1_${model}_${mode}'; print(json.dumps(d))" \
      >> "$FIG" || true
  done
done
echo "figures in $FIG"
