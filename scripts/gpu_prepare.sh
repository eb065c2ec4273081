#!/usr/bin/env bash
# Run HERE (not on the GPU machine) before `scripts/gpu_check.sh` is sent there with the device
# tool: downloads the wheels its image lacks into .whl/ (the image has torch 2.11, triton 3.6,
# transformers, tokenizers, aiohttp, pytest, ...; not pydantic, gguf, pyzmq, msgspec,
# llguidance) and copies what the checks need from ../shared into .gpu_assets/: stories260K,
# every tokenizer the HF parity matrix reads (llama2, llama3, qwen3, gguf-vocab) and
# make_bench_model.py. Both folders are git-ignored through .git/info/exclude; name both in
# each device call's `carry` (64 MiB at most together: checked at the end). The image is
# presumably Ubuntu 24.04 (its python3 is 3.12.3; glibc 2.39): manylinux_2_31 wheels
# (llguidance's) should install there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu_assets/' .git/info/exclude || echo '/.gpu_assets/' >> .git/info/exclude
rm -rf .whl .gpu_assets   # one version of each wheel: two stop the install there
PLATFORMS="--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for pkg in pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2 \
           gguf==0.17.1 pyzmq==27.1.0 msgspec==0.20.0 llguidance==1.9.1; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLATFORMS -d .whl "$pkg"
done
SHARED=../shared
mkdir -p .gpu_assets/models .gpu_assets/tokenizers .gpu_assets/bench
cp -r "$SHARED/models/stories260K-hf" .gpu_assets/models/
for tok in llama2 llama3 qwen3 gguf-vocab; do
  cp -r "$SHARED/tokenizers/$tok" .gpu_assets/tokenizers/
done
# make_bench_model.py reads ../tokenizers/llama2 from its own folder: .gpu_assets/tokenizers
cp "$SHARED/bench/make_bench_model.py" .gpu_assets/bench/
du -sh .whl .gpu_assets
total_kib=$(du -sk .whl .gpu_assets | awk '{s += $1} END {print s}')
if [ "$total_kib" -gt $((60 * 1024)) ]; then
  echo "gpu_prepare: .whl + .gpu_assets hold ${total_kib} KiB, over the 64 MiB a call carries" >&2
  exit 1
fi
