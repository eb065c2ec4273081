#!/usr/bin/env bash
# Run HERE (not on the GPU machine) before `scripts/gpu_check.sh` is sent there with the device
# tool: downloads the wheels its image lacks into .whl/ and copies what it needs from ../shared
# (stories260K, the Llama 2 tokenizer, make_bench_model.py) into .gpu_assets/. Both folders are
# git-ignored through .git/info/exclude; name both in the device call's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu_assets/' .git/info/exclude || echo '/.gpu_assets/' >> .git/info/exclude
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for pkg in pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2 \
           gguf==0.17.1 pyzmq==27.1.0 msgspec==0.20.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLATFORMS -d .whl "$pkg"
done
SHARED=../shared
mkdir -p .gpu_assets/models .gpu_assets/tokenizers .gpu_assets/bench
cp -r "$SHARED/models/stories260K-hf" .gpu_assets/models/
cp -r "$SHARED/tokenizers/llama2" .gpu_assets/tokenizers/
cp "$SHARED/bench/make_bench_model.py" .gpu_assets/bench/
du -sh .whl .gpu_assets
