"""The conformance kit's own reference: the built-in demo model's greedy tokens, recorded once
from Hugging Face transformers and shipped in the package (demo_reference.json).

The demo model (tessellm.models.demo) is built deterministically from a seed, so the kit needs
no download and no argument. The JSON holds the prompt, max_new_tokens, token_ids (prompt +
continuation, as transformers' float32 greedy `generate` produced them), the fingerprint of
the weights it was recorded on (weights_sha256), the smallest gap between the two best logits
over the continuation (min_top2_margin: how far from a tie each greedy choice is) and the
versions that recorded it. `scripts/record_conformance_reference.py` rewrites it;
tests/conformance/test_demo_reference.py checks the stored tokens still equal transformers'
output on the same weights, so the file cannot go stale.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tessellm.models.demo import DEMO_FORMAT_VERSION, demo_weights

REFERENCE_PATH = Path(__file__).with_name("demo_reference.json")
PROMPT = "Once upon a time"
MAX_NEW_TOKENS = 24


def weights_sha256() -> str:
    """A fingerprint of the demo model's tensors (names, shapes, float32 bytes, name order)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(demo_weights().items()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def load_reference(path: Path = REFERENCE_PATH) -> dict[str, Any]:
    """The stored reference; ValueError naming the file if it is not one of ours."""
    data = json.loads(path.read_text(encoding="utf-8"))
    missing = {"prompt", "max_new_tokens", "token_ids", "demo_format_version",
               "weights_sha256"} - set(data)
    if missing:
        raise ValueError(f"{path} lacks {sorted(missing)}: rewrite it with "
                         "scripts/record_conformance_reference.py")
    return data


def record_reference(model_dir: str | Path, prompt: str = PROMPT,
                     max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, Any]:
    """transformers' float32 greedy continuation of `prompt` on the demo model in `model_dir`
    (written by tessellm.models.demo.ensure_demo_model), as the reference JSON's fields."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             output_scores=True, return_dict_in_generate=True,
                             pad_token_id=tokenizer.eos_token_id)
    margins = [float(top[0] - top[1]) for top in
               (torch.topk(step[0].float(), 2).values for step in out.scores)]
    return {
        "model": "tessellm demo model (tessellm.models.demo)",
        "demo_format_version": DEMO_FORMAT_VERSION,
        "weights_sha256": weights_sha256(),
        "dtype": "float32",
        "prompt": prompt,
        "max_new_tokens": max_new_tokens,
        "token_ids": [int(t) for t in out.sequences[0]],
        "min_top2_margin": min(margins),
        "recorded_with": {"transformers": transformers.__version__,
                          "torch": torch.__version__.split("+")[0]},
    }
