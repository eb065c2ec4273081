"""IncrementalDetokenizer: streamed deltas add up to one decode, byte for byte, for
SentencePiece with byte fallback (stories260K, Llama 2) and byte-level BPE (GPT-2, Llama 3,
Qwen 3), on real text and on random ids; the first token after a prompt keeps its space; the
work per step stays within a small window."""
from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessellm.engine.detokenizer import (CONTEXT_TOKENS, REPLACEMENT, IncrementalDetokenizer,
                                         decode_continuation, space_cleanup, skipped_token_ids)

_BESIDE = Path(__file__).resolve().parents[2].parent / "shared"
SHARED = _BESIDE if _BESIDE.is_dir() else Path("/work/shared")
TOKENIZERS = SHARED / "tokenizers"

SENTENCEPIECE = ["stories260K", "llama2"]
BYTE_LEVEL = ["gpt2", "llama3", "qwen3"]
ALL = SENTENCEPIECE + BYTE_LEVEL

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Héllo  wörld — naïve café, Ærøskøbing; Ελληνικά, русский.",
    "中文测试：你好，世界！日本語のテキスト、한국어 문장.",
    "Emoji 😀🎉👩‍👩‍👧‍👦 and 🇫🇷 flags, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and ␣ symbols",
    "  leading spaces,   several   spaces\n\nnew lines\n\ttabs\r\n and trailing   ",
    "mixed: a中b😀c é\n中\n😀\n ",
]


def _load(name: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer, LlamaTokenizer
    if name == "stories260K":
        return AutoTokenizer.from_pretrained(str(SHARED / "models" / "stories260K-hf"), **kwargs)
    if name == "llama2":
        return LlamaTokenizer.from_pretrained(str(TOKENIZERS / "llama2"), **kwargs)
    if name == "gpt2":
        return AutoTokenizer.from_pretrained(str(TOKENIZERS / "gguf-vocab"),
                                             gguf_file="ggml-vocab-gpt-2.gguf", **kwargs)
    return AutoTokenizer.from_pretrained(str(TOKENIZERS / name), **kwargs)


@pytest.fixture(scope="session")
def tokenizer() -> Callable[[str], Any]:
    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cache[name] = _load(name)
        return cache[name]
    return get


def stream(tok: Any, prompt: Sequence[int], ids: Sequence[int], cuts: Sequence[int] = (),
           skip: bool = True) -> list[str]:
    """Deltas for ids fed in chunks (one id per step if no cuts), finish() last."""
    det = IncrementalDetokenizer(tok, prompt, skip)
    bounds = sorted({0, len(ids), *(c for c in cuts if 0 < c < len(ids))}) if cuts else \
        list(range(len(ids) + 1))
    deltas = [det.step(ids[a:b]) for a, b in itertools.pairwise(bounds)]
    return [*deltas, det.finish()]


def random_ids(tok: Any, name: str, allow_special: bool) -> st.SearchStrategy[list[int]]:
    """Ids from the whole vocabulary, biased towards single bytes (byte pieces, byte tokens)."""
    special = skipped_token_ids(tok)
    assert special
    low, high = (3, 258) if name in SENTENCEPIECE else (0, 300)
    one = st.one_of(st.integers(low, high), st.integers(0, len(tok) - 1))
    if allow_special:
        one = st.one_of(one, st.sampled_from(sorted(special)))
    else:
        one = one.filter(lambda i: i not in special)
    return st.lists(one, max_size=24)


FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("text", TEXTS)
def test_real_text_token_by_token(tokenizer, name: str, text: str) -> None:
    tok = tokenizer(name)
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, [], ids)
    expected = tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == expected
    assert not any(REPLACEMENT in d for d in deltas)  # never a half character


@pytest.mark.parametrize("name", ALL)
@given(data=st.data())
@FAST
def test_random_ids_add_up_to_decode(tokenizer, name: str, data: st.DataObject) -> None:
    tok = tokenizer(name)
    skip = data.draw(st.booleans(), label="skip")
    ids = data.draw(random_ids(tok, name, allow_special=True), label="ids")
    cuts = data.draw(st.lists(st.integers(1, max(1, len(ids))), max_size=8), label="cuts")
    assert "".join(stream(tok, [], ids, cuts, skip)) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", ALL)
@given(data=st.data())
@FAST
def test_random_ids_after_random_prompt(tokenizer, name: str, data: st.DataObject) -> None:
    tok = tokenizer(name)
    prompt = data.draw(random_ids(tok, name, allow_special=True), label="prompt")
    ids = data.draw(random_ids(tok, name, allow_special=False), label="ids")
    cuts = data.draw(st.lists(st.integers(1, max(1, len(ids))), max_size=8), label="cuts")
    text = "".join(stream(tok, prompt, ids, cuts))
    assert text == decode_continuation(tok, prompt, ids)
    alone = tok.decode(ids, skip_special_tokens=True)
    if name in BYTE_LEVEL:
        assert text == alone
    else:  # only the space a SentencePiece decode strips from the first "▁word" may differ
        assert text in (alone, " " + alone)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("text", TEXTS)
def test_continuation_of_a_real_prompt(tokenizer, name: str, text: str) -> None:
    """Split a real text's ids anywhere after a whole character: the streamed continuation
    is decode(all) minus decode(prompt)."""
    tok = tokenizer(name)
    ids = tok.encode(text, add_special_tokens=True)
    for cut in range(1, len(ids)):
        prompt, out = ids[:cut], ids[cut:]
        head = tok.decode(prompt, skip_special_tokens=True)
        whole = tok.decode(ids, skip_special_tokens=True)
        if REPLACEMENT in head or not whole.startswith(head):
            continue  # the prompt ends inside a character
        assert "".join(stream(tok, prompt, out)) == whole[len(head):], (cut, prompt)


@pytest.mark.parametrize("name", ALL)
def test_first_token_after_prompt_keeps_its_space(tokenizer, name: str) -> None:
    tok = tokenizer(name)
    prompt = tok.encode("Once upon a", add_special_tokens=True)
    whole = tok.encode("Once upon a time", add_special_tokens=True)
    assert whole[:len(prompt)] == prompt
    deltas = stream(tok, prompt, whole[len(prompt):])
    assert deltas[0] == " time" and "".join(deltas) == " time"


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_bos_only_prompt_starts_the_text(tokenizer, name: str) -> None:
    tok = tokenizer(name)
    ids = tok.encode("Once", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids[0]).startswith("▁")
    for skip in (True, False):
        assert "".join(stream(tok, [tok.bos_token_id], ids, skip=skip)) == "Once"


def _byte_piece(tok: Any, byte: int) -> int:
    return tok.convert_tokens_to_ids(f"<0x{byte:02X}>")


def test_byte_fallback_run_waits_for_its_end(tokenizer) -> None:
    """A complete character from byte pieces ("中") is still held: one more invalid byte turns
    the whole run into one U+FFFD per piece."""
    tok = tokenizer("stories260K")
    zh = [_byte_piece(tok, b) for b in "中".encode()]
    a = tok.encode("a", add_special_tokens=False)
    assert stream(tok, [], a + zh + a) == ["a", "", "", "", "中 a", ""]
    invalid = a + zh + [_byte_piece(tok, 0x80)]
    assert tok.decode(invalid) == "a" + REPLACEMENT * 4
    assert stream(tok, [], invalid) == ["a", "", "", "", "", REPLACEMENT * 4]
    newline = [_byte_piece(tok, 0x0A)]  # "\n" is a byte piece in Llama 2's vocabulary too
    assert stream(tok, [], newline + a) == ["", "\n a", ""]


@pytest.mark.parametrize("name", ALL)
def test_unfinished_character_at_the_end_decodes_as_a_whole(tokenizer, name: str) -> None:
    tok = tokenizer(name)
    emoji = "😀".encode()
    if name in SENTENCEPIECE:
        tail = [_byte_piece(tok, b) for b in emoji[:3]]
    else:  # byte-level BPE: byte 0xF0 is the token "ð" (GPT-2's printable byte alphabet)
        tail = [tok.convert_tokens_to_ids("ð")]
        assert tok.decode(tail) == REPLACEMENT
    ids = tok.encode("ok", add_special_tokens=False) + tail
    deltas = stream(tok, [], ids)
    assert "".join(deltas[:-1]) == "ok" and REPLACEMENT in deltas[-1]
    assert "".join(deltas) == tok.decode(ids)


def test_special_tokens_shown_or_skipped(tokenizer) -> None:
    tok = tokenizer("llama3")
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    ids = tok.encode("Hi there", add_special_tokens=False) + [eot]
    assert "".join(stream(tok, [], ids, skip=False)) == "Hi there<|eot_id|>"
    assert "".join(stream(tok, [], ids, skip=True)) == "Hi there"


def test_skipped_tokens_are_not_context(tokenizer) -> None:
    """Skipped specials add no text, so they do not count as context: the space of "▁b" after
    many of them is kept, as in decode."""
    tok = tokenizer("stories260K")
    ids = tok.encode("a", add_special_tokens=False) + [tok.eos_token_id] * 8 \
        + tok.encode("b", add_special_tokens=False)
    assert "".join(stream(tok, [], ids)) == tok.decode(ids, skip_special_tokens=True) == "a b"


class _Recording:
    """A tokenizer proxy recording the longest id list each decode call received."""

    def __init__(self, tok: Any) -> None:
        self._tok, self.longest = tok, 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self._tok.decode(ids, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._tok, attr)


@pytest.mark.parametrize("name", ALL)
def test_work_per_step_is_a_small_window(tokenizer, name: str) -> None:
    tok = _Recording(tokenizer(name))
    ids = tok.encode(" ".join(TEXTS) * 8, add_special_tokens=False, verbose=False)
    prompt = tok.encode("A long prompt " * 50, verbose=False)
    det = IncrementalDetokenizer(tok, prompt)
    tok.longest = 0  # setup decodes the special tokens once
    text = "".join(det.step([i]) for i in ids) + det.finish()
    assert len(ids) > 500 and text == decode_continuation(tokenizer(name), prompt, ids)
    # context + held tokens: a run of byte pieces (the ZWJ emoji family is 25 of them in
    # Llama 2), or the <= 3 bytes of an unfinished character for byte-level BPE
    pieces = "".join("b" if p.startswith("<0x") else " " for p in tok.convert_ids_to_tokens(ids))
    longest_run = max(len(run) for run in pieces.split(" "))
    assert tok.longest <= CONTEXT_TOKENS + max(longest_run, 3) + 1


@pytest.fixture(scope="module")
def cleaning_tokenizers(tokenizer) -> dict[str, Any]:
    """Copies that clean up spaces in decode (transformers 5 needs the second flag for BPE)."""
    out = {}
    for name in ("stories260K", "gpt2"):
        tok = copy.copy(tokenizer(name))
        tok.clean_up_tokenization_spaces = True
        tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
        out[name] = tok
    return out


CLEANUP_PIECES = [" .", " ?", " !", " ,", " ' ", " '", " n't", " 's", " 're", " 've", " 'm",
                  " ", "  ", " a", "n", "'", "t", "s", "re", ".", "x"]


@pytest.mark.parametrize("name", ["stories260K", "gpt2"])
@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_space_cleanup_is_applied_like_decode(cleaning_tokenizers, name: str,
                                              data: st.DataObject) -> None:
    """Where decode cleans up spaces (" ." -> "."), the streamed text does the same."""
    tok = cleaning_tokenizers[name]
    assert space_cleanup(tok) is not None
    words = data.draw(st.lists(st.sampled_from(CLEANUP_PIECES), max_size=14), label="words")
    ids = [i for w in words for i in tok.encode(w, add_special_tokens=False)]
    cuts = data.draw(st.lists(st.integers(1, max(1, len(ids))), max_size=8), label="cuts")
    assert "".join(stream(tok, [], ids, cuts)) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", ALL)
def test_default_cleanup_setting_is_followed(tokenizer, name: str) -> None:
    """Llama 3 sets clean_up_tokenization_spaces; whether decode honours it depends on the
    transformers version (5.x skips it for BPE): the stream follows decode either way."""
    tok = tokenizer(name)
    ids = tok.encode("I do n't know . Is it ? Yes , it 's fine ! They 're here", add_special_tokens=False)
    for cuts in ((), (1, 3, 4, 7, 9), (2, 5, 6, 8, 10, 12)):
        assert "".join(stream(tok, [], ids, cuts)) == tok.decode(ids, skip_special_tokens=True)
