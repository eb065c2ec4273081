#!/usr/bin/env bash
# The CUDA plugin's checks on a GPU, as two prepared calls of the device tool, each complete on
# a fresh machine and under 9 minutes (prepare first, here: scripts/gpu_prepare.sh):
#   run(command="bash scripts/gpu_check.sh correctness", carry=[".whl", ".gpu_assets"],
#       timeout_s=580)
#   run(command="bash scripts/gpu_check.sh performance", carry=[".whl", ".gpu_assets"],
#       timeout_s=580)
# correctness: the Triton kernels against the fp32 reference first (scripts/gpu_accuracy.py:
#   the 16-bit tensor-core attention the interpreter never ran, GPU exp/rsqrt/division, the
#   sampler's token agreement), device conformance on cuda (every failure listed, no stop at
#   the first), the HF parity matrix (fp32 and bf16) and stories260K against its reference,
#   the profiler's kernel table;
# performance: the bench models (110m, 1B) built, then W1 on each with CUDA graphs on and off,
#   and with graphs but without async scheduling.
# Each check runs under its own time budget, cut to what is left of BUDGET_S, so the call ends
# in time; a check out of time is recorded as skipped. Everything a call writes (log.txt,
# figures.jsonl with one JSON line per check, each check's full output) comes back as ONE
# archive, $OUT/gpu_check_<part>.tar.gz.
set -uo pipefail
PART="${1:-}"
case "$PART" in
  correctness|performance) ;;
  *) echo "usage: $0 correctness|performance" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check_out}"
WORK="/tmp/gpu_check/$PART"
BUDGET_S="${BUDGET_S:-520}"           # the call's limit is 580 s: margin for the archive
START=$(date +%s)
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
LOG="$WORK/log.txt"
FIG="$WORK/figures.jsonl"
: > "$FIG"
archive() { tar -czf "$OUT/gpu_check_$PART.tar.gz" -C "$(dirname "$WORK")" "$PART"; }
trap archive EXIT
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
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
$PY -m tessellm.cli.main plugins

json_str() { $PY -c 'import json,sys; print(json.dumps(sys.stdin.read()))'; }

figure() {  # name budget_s command...: runs it (within the budget and what is left of
            # BUDGET_S), appends {"check", "rc", "seconds", "tail"}; rc 124: timed out
  local name="$1" budget="$2"; shift 2
  local left=$(( START + BUDGET_S - $(date +%s) ))
  if [ "$left" -lt 15 ]; then
    echo "{\"check\": \"$name\", \"rc\": null, \"skipped\": \"out of time\"}" | tee -a "$FIG"
    return 1
  fi
  [ "$budget" -gt "$left" ] && budget=$left
  echo "=== $name (budget ${budget} s)"
  local t0 rc ms tail
  t0=$(date +%s%N)
  timeout -k 10 "$budget" "$@" > "$WORK/$name.out" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  tail=$(tail -c 600 "$WORK/$name.out" | json_str)
  printf '{"check": "%s", "rc": %d, "seconds": %d.%03d, "tail": %s}\n' \
    "$name" "$rc" $((ms / 1000)) $((ms % 1000)) "$tail" | tee -a "$FIG"
  return $rc
}

if [ "$PART" = correctness ]; then
  STORIES="$TESSELLM_SHARED_DIR/models/stories260K-hf"
  figure accuracy 100 $PY scripts/gpu_accuracy.py
  grep -h '^{' "$WORK/accuracy.out" >> "$FIG"
  figure conformance 150 env TESSELLM_TEST_DEVICES=cuda $PY -m pytest -q -rf \
    -p no:cacheprovider tests/conformance
  figure parity 180 env TESSELLM_TEST_DEVICE=cuda $PY -m pytest -q -rf -p no:cacheprovider \
    tests/models/test_hf_parity.py -k "greedy or logits or stories260k"
  figure kernels_stories 50 $PY -m tessellm.cli.main kernels --model "$STORIES" \
    --device cuda --dtype float32 --buckets 1,16,256 --json
else
  mkdir -p /tmp/models
  # (model, build budget, W1 budget per mode): the 1B's last mode is the first to go when
  # time runs short
  for spec in "bench110m 60 55" "bench1b 100 70"; do
    read -r model build_s run_s <<< "$spec"
    figure "make_$model" "$build_s" $PY .gpu_assets/bench/make_bench_model.py \
      "/tmp/models/$model" --shape "${model#bench}" || continue
    for mode in graphs eager graphs_sync; do   # graphs_sync: without async scheduling
      extra=()
      [ "$mode" = eager ] && extra=(--enforce-eager)
      [ "$mode" = graphs_sync ] && extra=(--no-async-scheduling)
      figure "w1_${model}_${mode}" "$run_s" $PY -m tessellm.cli.main bench throughput \
        --model "/tmp/models/$model" --device cuda --dtype bfloat16 --max-num-seqs 64 \
        --runs 3 "${extra[@]}"
      grep -h '^{' "$WORK/w1_${model}_${mode}.out" | tail -1 | \
        $PY -c "import json,sys; d=json.load(sys.stdin); d['check']='w1_${model}_${mode}'; print(json.dumps(d))" \
        >> "$FIG" || true
    done
  done
fi
echo "figures in $FIG; archive $OUT/gpu_check_$PART.tar.gz"
