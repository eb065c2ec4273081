"""Incremental detokenization: token ids in, text deltas out, in total equal to one decode.

Invariant, for any ids and any split of them into steps (the tests check it with random ids):

    "".join(step(chunk) for chunk in chunks) + finish()
        == decode_continuation(tokenizer, prompt_token_ids, ids, skip_special_tokens)

and with an empty prompt that is exactly `tokenizer.decode(ids, skip_special_tokens=...)`, byte
for byte, U+FFFD included where the bytes are truly invalid. With a prompt, the text is what
`decode(context + ids)` adds to `decode(context)`, context being the prompt's last few tokens:
a SentencePiece first token "▁time" after "Once upon a" streams as " time" (decode(ids) alone
strips that space); for byte-level BPE (GPT-2, Llama 3, Qwen) the two are equal.

How (the prefix/read-offset technique): a window holds CONTEXT_TOKENS already-streamed tokens
followed by the tokens not streamed yet; a step decodes only the window and emits
decode(window) minus decode(context). Text is held back while it could still change:
  - the window's text ends in U+FFFD: byte-level BPE split a character's bytes over tokens;
  - the last token is a byte piece <0xNN>: SentencePiece's ByteFallback decodes a whole run of
    byte pieces at once, as one U+FFFD per piece if the run is not valid UTF-8, so a later byte
    can still change the text of earlier ones; the run waits until a non-byte piece ends it;
  - where the tokenizer's decode cleans up spaces (" ." -> "."), raw text within
    CLEANUP_REACH characters after a space.
Cost per step: O(window) = O(CONTEXT_TOKENS + tokens held back), never O(total length).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

CONTEXT_TOKENS = 5
CLEANUP_REACH = 3  # transformers' cleanup patterns (" n't", " 's", " .") are <= 4 chars long
REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def skipped_token_ids(tokenizer: Any) -> frozenset[int]:
    """The special ids `decode(..., skip_special_tokens=True)` drops, exactly: for it they do
    not exist (no text, a byte run goes on across them), so the detokenizer drops them too."""
    candidates = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            candidates.add(token_id)
    if not candidates or _decode(tokenizer, sorted(candidates), True) == "":
        return frozenset(candidates)
    return frozenset(i for i in candidates if _decode(tokenizer, [i], True) == "")


def space_cleanup(tokenizer: Any) -> Callable[[str], str] | None:
    """The text cleanup `tokenizer.decode` applies by default (" ." -> "."), or None.

    Probed, not read from the flag: recent transformers ignore the flag for BPE models."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    probe = tokenizer.encode("a . b", add_special_tokens=False)
    raw = tokenizer.decode(probe, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if tokenizer.decode(probe, skip_special_tokens=True) == raw:
        return None
    return tokenizer.clean_up_tokenization


def _decode(tokenizer: Any, ids: Sequence[int], skip: bool) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _is_byte_piece(tokenizer: Any, token_id: int) -> bool:
    token = tokenizer.convert_ids_to_tokens(token_id)
    return isinstance(token, str) and _BYTE_PIECE.fullmatch(token) is not None


def prompt_context(tokenizer: Any, prompt_token_ids: Sequence[int],
                   skipped: frozenset[int]) -> list[int]:
    """The prompt's last CONTEXT_TOKENS non-special tokens before its last stable point.

    Stable: decode(context) is a prefix of decode(context + anything). Tokens after that point
    (an unfinished byte run or UTF-8 character) are left out, so the output decodes as if the
    prompt ended there. Special tokens are left out, so a bare BOS prompt starts a new text
    (no leading space). A prompt with text but no stable point near its end gets a neutral
    anchor token ("a") instead, so the output still continues a text."""
    tail = [t for t in prompt_token_ids[-4 * CONTEXT_TOKENS:] if t not in skipped]
    if not tail:
        return []
    while tail and not _stable(tokenizer, tail[-CONTEXT_TOKENS:]):
        tail.pop()
    if not tail:
        anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        tail = anchor if anchor and _stable(tokenizer, anchor) else []
    return tail[-CONTEXT_TOKENS:]


def _stable(tokenizer: Any, ids: list[int]) -> bool:
    return (not _is_byte_piece(tokenizer, ids[-1])
            and not _decode(tokenizer, ids, True).endswith(REPLACEMENT))


def _cleanup_cut(raw: str) -> int:
    """The largest cut with no space in the CLEANUP_REACH chars before it: cleanup never
    joins text across such a cut, so cleanup(a + b) == cleanup(a) + cleanup(b) there."""
    cut = len(raw)
    while cut > 0:
        space = raw.rfind(" ", max(0, cut - CLEANUP_REACH), cut)
        if space < 0:
            return cut
        cut = space
    return 0


def decode_continuation(tokenizer: Any, prompt_token_ids: Sequence[int],
                        output_token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The text IncrementalDetokenizer streams for output_token_ids, in one go (O(length))."""
    context = prompt_context(tokenizer, prompt_token_ids, skipped_token_ids(tokenizer))
    head = _decode(tokenizer, context, skip_special_tokens)
    raw = _decode(tokenizer, [*context, *output_token_ids], skip_special_tokens)[len(head):]
    cleanup = space_cleanup(tokenizer)
    return cleanup(raw) if cleanup else raw


class IncrementalDetokenizer:
    """Streams one request's output text; see the module docstring for the invariant.

    Window invariant: `_ids` = context tokens (already streamed, at most CONTEXT_TOKENS, the
    last not a byte piece) + held tokens; `_context_text` = decode(context tokens). Skipped
    special tokens never enter the window. `finish()` ends the stream."""

    __slots__ = ("_cleanup", "_context_text", "_ids", "_pending", "_skip", "_skipped", "_tok")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        skipped = skipped_token_ids(tokenizer)
        self._skipped = skipped if skip_special_tokens else frozenset()
        self._cleanup = space_cleanup(tokenizer)
        self._ids = prompt_context(tokenizer, prompt_token_ids, skipped)
        self._context_text = _decode(tokenizer, self._ids, skip_special_tokens)
        self._pending = ""  # raw text not yet cleaned up (only when cleanup applies)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Take newly generated ids; return the text that is now final ("" if held back)."""
        new = [t for t in new_token_ids if t not in self._skipped]
        if not new:
            return ""
        self._ids.extend(new)
        if _is_byte_piece(self._tok, self._ids[-1]):
            return ""
        text = _decode(self._tok, self._ids, self._skip)
        if text.endswith(REPLACEMENT):
            return ""
        return self._clean(self._advance(text), final=False)

    def finish(self) -> str:
        """All text still held back (maybe ""), taking the ids so far as the whole output."""
        text = _decode(self._tok, self._ids, self._skip)
        return self._clean(self._advance(text), final=True)

    def _advance(self, text: str) -> str:
        """Stream everything in the window: return its new raw text, keep a new context."""
        delta = text[len(self._context_text):]
        start = max(0, len(self._ids) - CONTEXT_TOKENS)
        if start:
            del self._ids[:start]
            text = _decode(self._tok, self._ids, self._skip)
        self._context_text = text
        return delta

    def _clean(self, raw: str, final: bool) -> str:
        if self._cleanup is None:
            return raw
        pending = self._pending + raw
        cut = len(pending) if final else _cleanup_cut(pending)
        self._pending = pending[cut:]
        return self._cleanup(pending[:cut])
