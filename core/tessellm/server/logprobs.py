"""Token strings and the OpenAI logprobs objects (completions and chat shapes).

A token's string is the text it adds after another token: decode([anchor, id]) minus
decode([anchor]). Decoding the id alone would lose a SentencePiece leading space ("▁the" ->
"the"). A byte-fallback piece (`<0xE6>`) has no text of its own; its string is the
replacement character and its `bytes` are the raw byte, so a client can rebuild the UTF-8.
Logprobs of masked tokens (-inf) are reported as -9999.0: JSON has no infinity.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class TokenTexts:
    """Per-id token strings and bytes, computed once per id (the cache is bounded by the
    vocabulary). Used from the event loop only."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        anchor = tokenizer.encode("a", add_special_tokens=False)
        self._anchor = anchor[-1:] if anchor else []
        self._anchor_text = tokenizer.decode(self._anchor) if self._anchor else ""
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._tok.convert_ids_to_tokens(token_id)
        m = _BYTE_PIECE.fullmatch(piece) if isinstance(piece, str) else None
        if m is not None:
            return "\ufffd", [int(m.group(1), 16)]
        both = self._tok.decode(self._anchor + [token_id])
        if self._anchor and both.startswith(self._anchor_text):
            text = both[len(self._anchor_text):]
        else:
            text = self._tok.decode([token_id])
        return text, list(text.encode("utf-8"))

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


class CompletionLogprobs:
    """Builds `choices[].logprobs` of /v1/completions for one choice, chunk after chunk;
    text_offset runs on across chunks (offsets into this choice's text: with echo, the prompt
    comes first). An entry whose `logprob` is None (echo's first prompt token, which nothing
    predicts) has null token_logprobs and top_logprobs, as OpenAI answers."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self._offset = 0

    def build(self, entries: Sequence[Any]) -> dict[str, list]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for e in entries:
            text = self._texts.text(e.token_id)
            out["tokens"].append(text)
            if e.logprob is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(finite(e.logprob))
                out["top_logprobs"].append({self._texts.text(t): finite(lp) for t, lp in e.top})
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out


def chat_logprobs(texts: TokenTexts, entries: Sequence[Any]) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` entries of /v1/chat/completions."""
    content = []
    for e in entries:
        text, raw = texts.get(e.token_id)
        top = []
        for t, lp in e.top:
            ttext, traw = texts.get(t)
            top.append({"token": ttext, "logprob": finite(lp), "bytes": traw})
        content.append({"token": text, "logprob": finite(e.logprob), "bytes": raw,
                        "top_logprobs": top})
    return content
