#!/usr/bin/env python3
"""Rewrites core/tessellm/testing/demo_reference.json, the conformance kit's reference: the
built-in demo model's float32 greedy tokens from Hugging Face transformers.

    .venv/bin/python scripts/record_conformance_reference.py [--check]

Needed only when the demo model (tessellm.models.demo) or the prompt changes; with --check it
writes nothing and exits 1 if the stored file differs from a fresh recording (what
tests/conformance/test_demo_reference.py asserts).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

from tessellm.models.demo import ensure_demo_model
from tessellm.testing.demo_reference import REFERENCE_PATH, load_reference, record_reference


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = record_reference(ensure_demo_model(f"{tmp}/demo-model"))
    if args.check:
        stored = load_reference()
        same = all(stored[k] == fresh[k] for k in ("prompt", "max_new_tokens", "token_ids",
                                                     "weights_sha256", "demo_format_version"))
        print(f"{REFERENCE_PATH}: {'up to date' if same else 'STALE'}")
        return 0 if same else 1
    text = json.dumps({**fresh, "token_ids": "@ids"}, indent=2)   # the ids on one line
    text = text.replace('"@ids"', json.dumps(fresh["token_ids"]))
    REFERENCE_PATH.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {REFERENCE_PATH}: {len(fresh['token_ids'])} token ids, min top-2 logit margin "
          f"{fresh['min_top2_margin']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
