"""The model's tokenizer as llguidance reads it (an LLTokenizer), built once per engine.

It is built from the Hugging Face tokenizer's Rust backend (`backend_tokenizer`: every fast
tokenizer, and the tokenizers transformers builds from a GGUF file), with the vocabulary as
wide as the model's logits (`vocab_size`: ids past the tokenizer's own words are never
allowed) and the engine's EOS ids, so that EOS is allowed exactly where the grammar may end.
Building one reads the whole vocabulary (about 0.3 s for 49k tokens, 1.3 s for 152k).
"""
from __future__ import annotations

from collections.abc import Iterable
from copy import copy
from typing import Any

from tessellm.errors import InvalidRequestError


def guidance_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> Any:
    from llguidance import LLTokenizer
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise InvalidRequestError(
            f"constrained decoding needs a fast (Rust) tokenizer; this model's is "
            f"{type(hf_tokenizer).__name__}")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    eos = sorted(set(eos_token_ids)) or None
    return LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
