"""The model's tokenizer as llguidance reads it (an LLTokenizer), built once per engine.

It is built from the Hugging Face tokenizer's Rust backend (`backend_tokenizer`: every fast
tokenizer, and the tokenizers transformers builds from a GGUF file), with the vocabulary as
wide as the model's logits (`vocab_size`: ids past the tokenizer's own words are never
allowed) and the engine's EOS ids, so that EOS is allowed exactly where the grammar may end.
Building one reads the whole vocabulary (time grows with its size); the
server's engine core builds it on a thread of its own right after it is ready
(GrammarCompiler.prefetch_tokenizer), so the first constrained request does not wait for it
(the build holds the interpreter lock for most of its time once, which an idle core just
started does not notice). The tokenizer's
JSON is read as it is (a copy of the Rust tokenizer would serialize it under the lock), with
padding and truncation taken out of the text where set.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tessellm.errors import InvalidRequestError


def guidance_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> Any:
    from llguidance import LLTokenizer
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise InvalidRequestError(
            f"constrained decoding needs a fast (Rust) tokenizer; this model's is "
            f"{type(hf_tokenizer).__name__}")
    text = backend.to_str()
    if backend.padding is not None or backend.truncation is not None:
        spec = json.loads(text)
        spec["padding"] = spec["truncation"] = None
        text = json.dumps(spec)
    eos = sorted(set(eos_token_ids)) or None
    return LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
