#!/usr/bin/env bash
# CI's wheel job: tessellm as a user installs it, not editable. Builds the wheels of tessellm
# (with its CPU plugin), tessellm-cuda and tessellm-xla (`pip wheel --no-deps`) from a copy of
# the tree, installs them into a fresh virtual environment outside the repository (torch pinned
# to the CPU wheel 2.13.0, as in setup.sh: an unpinned torch pulls a multi-GB CUDA build;
# tessellm-xla without its dependencies, since torch-xla needs another torch — its device must
# then report itself unavailable, loudly), and from there:
#   - every native CPU kernel the source tree's install (.venv) offers is offered (so the
#     wheel carries every C source and header the kernels build from);
#   - `tessellm conformance --device cpu` with no other argument passes (its end-to-end check
#     builds the demo model and compares the reference tokens shipped in the wheel);
#   - `tessellm generate` on stories260K (${TESSELLM_SHARED_DIR:-../shared}/models/stories260K-hf).
# Needs no network but the package registries. Takes a few minutes (mostly installing torch).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PYTHON="${PYTHON:-python3}"
STORIES="${TESSELLM_SHARED_DIR:-$REPO/../shared}/models/stories260K-hf"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/tessellm-wheels.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
step() { echo "wheel_check: $*"; }

[ -f "$STORIES/config.json" ] || { echo "wheel_check: no stories260K-hf at $STORIES" >&2; exit 1; }

step "copying the tree (tracked and unignored files) to $WORK/src"
mkdir -p "$WORK/src"
git ls-files -z --cached --others --exclude-standard \
  | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$WORK/src"

step "building wheels"
"$PYTHON" -m venv "$WORK/venv"
PIP=("$WORK/venv/bin/python" -m pip)
"${PIP[@]}" wheel -q --no-deps -w "$WORK/wheels" \
  "$WORK/src" "$WORK/src/plugins/cuda" "$WORK/src/plugins/xla"
ls "$WORK/wheels"

step "installing them into a fresh venv"
"${PIP[@]}" install -q "torch==2.13.0"
"${PIP[@]}" install -q "$WORK"/wheels/tessellm-[0-9]*.whl "$WORK"/wheels/tessellm_cuda-*.whl \
  "torch==2.13.0"
"${PIP[@]}" install -q --no-deps "$WORK"/wheels/tessellm_xla-*.whl

# From outside the repository, with a cache of its own: nothing comes from the source tree.
cd "$WORK"
export TESSELLM_CACHE_DIR="$WORK/cache"
unset TESSELLM_CONFORMANCE_MODEL TRITON_INTERPRET
"$WORK/venv/bin/python" - "$REPO" <<'EOF'
"""tessellm and its plugins import from the venv; the wheel offers every CPU kernel .venv does."""
import json, subprocess, sys
from pathlib import Path
import tessellm, tessellm_cpu, tessellm_cuda, tessellm_xla

repo = Path(sys.argv[1])
for module in (tessellm, tessellm_cpu, tessellm_cuda, tessellm_xla):
    where = Path(module.__file__).resolve()
    assert repo not in where.parents, f"{module.__name__} imported from the source tree: {where}"

def cpu_row(tessellm_bin):
    rows = json.loads(subprocess.run([str(tessellm_bin), "plugins", "--json"], check=True,
                                     capture_output=True, text=True).stdout)
    return {r["plugin"]: r for r in rows}, next(
        d for r in rows for d in r["devices"] if d["name"] == "cpu")

rows, cpu = cpu_row(Path(sys.prefix) / "bin" / "tessellm")
missing = cpu.get("kernels_not_offered", {})
if (repo / ".venv" / "bin" / "tessellm").exists():   # what the source tree offers here
    _, dev_cpu = cpu_row(repo / ".venv" / "bin" / "tessellm")
    missing = {k: v for k, v in missing.items() if k not in dev_cpu.get("kernels_not_offered", {})}
assert cpu["available"] and not missing, f"CPU kernels the wheel does not offer: {missing}"
xla = next(d for d in rows["xla"]["devices"] if d["name"] == "xla") if rows["xla"]["devices"] \
    else None
assert rows["xla"]["status"] != "loaded" or (xla is not None and not xla["available"]), \
    "tessellm-xla without torch-xla should not offer an available device"
print(f"wheel_check: every CPU kernel offered; tessellm-xla without torch-xla: "
      f"{rows['xla']['error'] or xla['reason']}")
EOF

step "tessellm conformance --device cpu"
"$WORK/venv/bin/tessellm" conformance --device cpu | tail -3

step "tessellm generate on stories260K"
"$WORK/venv/bin/tessellm" generate --model "$STORIES" --prompt "Once upon a time" \
  --max-tokens 16 --temperature 0
step "passed"
