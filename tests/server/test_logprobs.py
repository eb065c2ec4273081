"""Token strings for logprobs: SentencePiece spaces kept, byte pieces as raw bytes."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from tessellm.server.logprobs import MIN_LOGPROB, CompletionLogprobs, TokenTexts, chat_logprobs
from transformers import AutoTokenizer


@dataclass
class Entry:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@pytest.fixture(scope="module")
def texts(stories_dir):
    return TokenTexts(AutoTokenizer.from_pretrained(str(stories_dir)))


def test_token_strings_keep_the_leading_space_and_join_to_the_text(texts):
    tok = texts._tok
    ids = tok.encode("Once upon a time, there was", add_special_tokens=False)
    assert "".join(texts.text(i) for i in ids) == " Once upon a time, there was"
    assert texts.text(tok.convert_tokens_to_ids("▁t")) == " t"


def test_byte_pieces_report_their_raw_byte(texts):
    ids = texts._tok.encode("日", add_special_tokens=False)
    pieces = [texts.get(i) for i in ids if texts._tok.convert_ids_to_tokens(i).startswith("<0x")]
    assert bytes(b for _, raw in pieces for b in raw) == "日".encode()
    assert all(text == "\ufffd" for text, _ in pieces)


def test_completion_offsets_run_on_across_chunks_and_inf_is_clamped(texts):
    tok = texts._tok
    a, b = tok.encode(" Once upon", add_special_tokens=False)[:2]
    lp = CompletionLogprobs(texts)
    first = lp.build([Entry(a, -0.5, [(a, -0.5), (b, float("-inf"))])])
    second = lp.build([Entry(b, -1.0, [])])
    assert first["text_offset"] == [0] and second["text_offset"] == [len(texts.text(a))]
    assert first["top_logprobs"][0][texts.text(b)] == MIN_LOGPROB
    chat = chat_logprobs(texts, [Entry(a, float("-inf"), [(b, -2.0)])])
    assert chat[0]["logprob"] == MIN_LOGPROB and chat[0]["top_logprobs"][0]["logprob"] == -2.0
    assert chat[0]["bytes"] == list(texts.text(a).encode())
