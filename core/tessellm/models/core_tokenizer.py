"""The engine core's tokenizer: what the core reads of one (the EOS id, the Rust tokenizer
that llguidance compiles grammars against, `decode` for diagnostics), loaded from a tokenizer
cache entry (tessellm.models.tokenizer_cache) with the `tokenizers` library alone. Importing
transformers would be a large share of an engine core's start; the server's front end, which templates,
encodes and decodes, holds the full tokenizer.

Only cache entries are read this way: they were written by transformers' save_pretrained, so
their `tokenizer.json` holds every token the full tokenizer has and their
`tokenizer_config.json` names the EOS token. Anything else (an HF directory's own files, an
entry without an EOS token) gets the full tokenizer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class CoreTokenizer:
    backend_tokenizer: Any    # tokenizers.Tokenizer
    eos_token_id: int

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(token_ids),
                                             skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def load_core_tokenizer(entry: Path) -> CoreTokenizer | None:
    """The core's tokenizer from a complete cache entry, or None (use the full tokenizer)
    when its files or its EOS token cannot be read."""
    try:
        config = json.loads((entry / "tokenizer_config.json").read_text(encoding="utf-8"))
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if not isinstance(eos, str):
            return None
        from tokenizers import Tokenizer
        backend = Tokenizer.from_file(str(entry / "tokenizer.json"))
    except (OSError, ValueError, Exception):   # tokenizers raises its own Exception kinds
        return None
    eos_id = backend.token_to_id(eos)
    return None if eos_id is None else CoreTokenizer(backend, eos_id)
