"""End to end: greedy decoding on the device equals recorded reference tokens.

Two checks, both float32 with `kernel_selection: first`:
- `end_to_end.demo` always runs and needs nothing: the built-in demo model, built from its
  seed into the cache directory (tessellm.models.demo), against the tokens shipped in the
  package (demo_reference.json, recorded from transformers).
- `end_to_end.stories260K` runs only when a model directory holding `reference_greedy.json`
  (prompt, max_new_tokens, token_ids = prompt + continuation) is named: the `model_dir`
  argument (`--model`), else $TESSELLM_CONFORMANCE_MODEL. A named directory without that file
  fails the check.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tessellm.testing.kernel_checks import CheckFailed

MODEL_ENV = "TESSELLM_CONFORMANCE_MODEL"
REFERENCE_FILE = "reference_greedy.json"


def named_model_dir(model_dir: str | Path | None = None) -> tuple[str, str] | None:
    """(path, where it was named) of the reference model directory, or None if none is."""
    if model_dir:
        return str(model_dir), "--model"
    if os.environ.get(MODEL_ENV):
        return os.environ[MODEL_ENV], f"${MODEL_ENV}"
    return None


def _greedy_matches(manager, device_name: str, path: Path, ref: dict[str, Any],
                    source: str) -> str:
    """Greedy decoding of the reference prompt; prompt + output ids must equal the reference."""
    from tessellm import LLM, SamplingParams   # the top layer: only when this check runs
    want = ref["token_ids"] if isinstance(ref["token_ids"], list) else json.loads(ref["token_ids"])
    llm = LLM(str(path), plugins=manager, device=device_name, dtype="float32",
              load_progress=False, max_num_seqs=4, max_num_batched_tokens=64,
              kernel_selection="first")
    out = llm.generate([ref["prompt"]], SamplingParams(max_tokens=ref["max_new_tokens"],
                                                       temperature=0.0))[0]
    prompt_ids = llm.encode(ref["prompt"])
    got = prompt_ids + list(out.token_ids)
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                     min(len(got), len(want)))
        raise CheckFailed(f"greedy tokens differ from {source} at position {first}: got "
                          f"{got[first:first + 5]}..., reference {want[first:first + 5]}...")
    return (f"{len(want) - len(prompt_ids)} greedy tokens equal the reference "
            "(float32, kernel_selection first)")


def check_demo_greedy(manager, device_name: str) -> str:
    """The demo model's greedy tokens against the shipped reference."""
    from tessellm.models.demo import DEMO_FORMAT_VERSION, ensure_demo_model
    from tessellm.testing.demo_reference import REFERENCE_PATH, load_reference, weights_sha256
    ref = load_reference()
    if (ref["demo_format_version"] != DEMO_FORMAT_VERSION
            or ref["weights_sha256"] != weights_sha256()):
        raise CheckFailed(f"{REFERENCE_PATH.name} was recorded on other demo weights than this "
                          "installation builds (demo format "
                          f"{ref['demo_format_version']}, now {DEMO_FORMAT_VERSION}; or another "
                          "torch draws other numbers): rewrite it with "
                          "scripts/record_conformance_reference.py")
    detail = _greedy_matches(manager, device_name, ensure_demo_model(), ref, REFERENCE_PATH.name)
    return f"demo model: {detail}"


def check_stories_greedy(manager, device_name: str, model_dir: str | Path | None) -> str:
    """The named model directory's greedy tokens against its reference_greedy.json."""
    named = named_model_dir(model_dir)
    if named is None:
        raise CheckFailed(f"no model directory named; pass --model DIR or set ${MODEL_ENV}")
    path, source = Path(named[0]), named[1]
    if not (path / REFERENCE_FILE).is_file():
        raise CheckFailed(f"{source} = {path} holds no {REFERENCE_FILE}")
    ref = json.loads((path / REFERENCE_FILE).read_text())
    return _greedy_matches(manager, device_name, path, ref, str(path / REFERENCE_FILE))
