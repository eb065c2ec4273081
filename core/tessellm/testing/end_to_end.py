"""End to end: stories260K's greedy continuation on the device equals the reference tokens.

The model directory is a stories260K-hf checkout holding `reference_greedy.json` (prompt,
max_new_tokens, token_ids = prompt + continuation, produced by transformers in float32). It is
found from, in order: the `model_dir` argument (`--model`), $TESSELLM_CONFORMANCE_MODEL, and
$TESSELLM_SHARED_DIR/models/stories260K-hf. Not finding it fails the check; it is never skipped.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tessellm.testing.kernel_checks import CheckFailed

MODEL_ENV = "TESSELLM_CONFORMANCE_MODEL"
SHARED_ENV = "TESSELLM_SHARED_DIR"
REFERENCE_FILE = "reference_greedy.json"


def find_model_dir(model_dir: str | Path | None = None) -> Path:
    """The stories260K directory to use; CheckFailed saying where it looked if none."""
    tried = []
    candidates = [(str(model_dir), "--model")] if model_dir else []
    if os.environ.get(MODEL_ENV):
        candidates.append((os.environ[MODEL_ENV], f"${MODEL_ENV}"))
    if os.environ.get(SHARED_ENV):
        candidates.append((str(Path(os.environ[SHARED_ENV]) / "models" / "stories260K-hf"),
                           f"${SHARED_ENV}/models/stories260K-hf"))
    for path, source in candidates:
        if (Path(path) / REFERENCE_FILE).is_file():
            return Path(path)
        tried.append(f"{source} = {path}")
    raise CheckFailed("stories260K-hf with reference_greedy.json not found ("
                      + ("; ".join(tried) if tried else "nothing given")
                      + f"); pass --model DIR or set ${MODEL_ENV}")


def check_stories_greedy(manager, device_name: str, model_dir: str | Path | None) -> str:
    """Greedy decoding of the reference prompt; prompt + output ids must equal the reference."""
    from tessellm import LLM, SamplingParams   # the top layer: only when this check runs
    path = find_model_dir(model_dir)
    ref = json.loads((path / REFERENCE_FILE).read_text())
    want = ref["token_ids"] if isinstance(ref["token_ids"], list) else json.loads(ref["token_ids"])
    llm = LLM(str(path), plugins=manager, device=device_name, dtype="float32",
              load_progress=False, max_num_seqs=4, max_num_batched_tokens=64,
              kernel_selection="first")
    out = llm.generate([ref["prompt"]], SamplingParams(max_tokens=ref["max_new_tokens"],
                                                       temperature=0.0))[0]
    got = llm.encode(ref["prompt"]) + list(out.token_ids)
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                     min(len(got), len(want)))
        raise CheckFailed(f"greedy tokens differ from {path / REFERENCE_FILE} at position "
                          f"{first}: got {got[first:first + 5]}..., reference "
                          f"{want[first:first + 5]}...")
    return (f"{len(want) - len(llm.encode(ref['prompt']))} greedy tokens equal the reference "
            "(float32, kernel_selection first)")
