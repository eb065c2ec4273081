"""StopStringMatcher: the emitted text is the text cut before the first stop string, whatever
the split into deltas; only a possible start of a stop string is held back; bad stops raise."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessellm.engine.stop_strings import MAX_STOP_STRINGS, StopStringMatcher
from tessellm.errors import InvalidRequestError
from tessellm.sampling_params import SamplingParams


def expected_cut(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Oracle: the occurrence that ends first (the longest of those ending together)."""
    best: tuple[int, int] | None = None  # (end, -length)
    matched = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (best is None or (at + len(stop), -len(stop)) < best):
            best, matched = (at + len(stop), -len(stop)), stop
    if best is None:
        return text, None
    return text[:best[0] + best[1]], matched


def run(stops: Sequence[str], deltas: Sequence[str]) -> tuple[list[str], bool, StopStringMatcher]:
    m = StopStringMatcher(stops)
    out: list[str] = []
    stopped = False
    for delta in deltas:
        text, stopped = m.feed(delta)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return out, stopped, m


def split(text: str, cuts: Sequence[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c for c in cuts if 0 < c < len(text))})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


ALPHABET = "ab\n ."
stop_st = st.text(ALPHABET, min_size=1, max_size=5)


@given(text=st.text(ALPHABET, max_size=40), stops=st.lists(stop_st, min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=12))
@settings(max_examples=400, deadline=None)
def test_emitted_text_is_cut_before_first_stop(text: str, stops: list[str],
                                               cuts: list[int]) -> None:
    out, stopped, m = run(stops, split(text, cuts))
    want, matched = expected_cut(text, stops)
    assert "".join(out) == want
    assert stopped == (matched is not None) and m.stopped == stopped
    assert m.matched == matched


@given(text=st.text(ALPHABET, max_size=30), stops=st.lists(stop_st, min_size=1, max_size=4))
@settings(max_examples=300, deadline=None)
def test_only_a_possible_stop_start_is_held(text: str, stops: list[str]) -> None:
    """Char by char: until a stop matches, everything is emitted except the longest suffix
    that a stop string starts with."""
    m = StopStringMatcher(stops)
    emitted = ""
    for i, ch in enumerate(text):
        delta, stopped = m.feed(ch)
        emitted += delta
        if stopped:
            break
        seen = text[:i + 1]
        held = max((k for k in range(len(seen) + 1)
                    if any(len(s) > k and s.startswith(seen[len(seen) - k:]) for s in stops)),
                   default=0)
        assert emitted == seen[:len(seen) - held]


def test_stop_spanning_deltas() -> None:
    out, stopped, m = run(["###"], ["Hello #", "#", "# world"])
    assert out == ["Hello ", "", ""] and stopped and m.matched == "###"


def test_false_start_is_released() -> None:
    out, stopped, _ = run(["</end>"], ["a </e", "nd", "x> b"])
    assert out == ["a ", "", "</endx> b", ""] and not stopped


def test_held_text_is_flushed_at_the_end() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("run ST") == ("run ", False)
    assert m.flush() == "ST"
    assert not m.stopped


def test_stop_at_once_and_after_stopping() -> None:
    m = StopStringMatcher(["\n\n", "User:"])
    assert m.feed("Answer.\n\nUser: more") == ("Answer.", True)
    assert m.matched == "\n\n"
    assert m.feed("ignored") == ("", True)
    assert m.flush() == ""


def test_first_completed_stop_wins() -> None:
    """"bc" is complete before "abcd" could be: generation stops there, as OpenAI does."""
    assert run(["abcd", "bc"], ["abcd"])[0] == ["a"]
    assert run(["abcd", "bc"], ["ab", "cd"])[0] == ["", "a"]
    assert run(["c", "abc"], ["xabc"])[0] == ["x"]  # same end: the longer one


def test_unicode_stops() -> None:
    out, stopped, m = run(["😀", "終"], ["中文", "😀", "more"])
    assert out == ["中文", ""] and stopped and m.matched == "😀"


def test_empty_stop_list_passes_text_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False) and m.flush() == ""


@pytest.mark.parametrize("stops", [[""], ["ok", ""], [None], [3]])
def test_invalid_stops_are_rejected(stops: list) -> None:
    with pytest.raises(InvalidRequestError):
        StopStringMatcher(stops)


def test_stop_count_limit() -> None:
    """One limit (MAX_STOP_STRINGS, 16) for the matcher, SamplingParams and the schema."""
    many = [chr(ord("a") + i) for i in range(MAX_STOP_STRINGS + 1)]
    assert StopStringMatcher(many[:-1]).stops == tuple(many[:-1])
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_STRINGS}"):
        StopStringMatcher(many)
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_STRINGS}"):
        SamplingParams(stop=many)
    assert SamplingParams(stop=many[:-1]).stop == many[:-1]
    assert StopStringMatcher(many, max_stops=len(many)).stops == tuple(many)
    assert StopStringMatcher(many * 3, max_stops=None).stops == tuple(many)
    assert StopStringMatcher(["x"] * 20).stops == ("x",)  # duplicates count once
    assert StopStringMatcher("end").stops == ("end",)  # a single string, as OpenAI allows
