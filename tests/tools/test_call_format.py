"""Tool-call formats: golden outputs of each format, whole and streamed split at every chunk
boundary (the streamed calls reassemble to the whole ones), malformed outputs kept as content,
outputs cut off inside a call, and the grammar that forces calls accepts valid calls of the
listed tools only."""
from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher, LLTokenizer

from tessellm.tools.call_format import (ArgumentsDelta, CallStarted, ContentDelta, ToolSpec)
from tessellm.tools.formats import (HERMES, LLAMA3_JSON, MISTRAL, choose_format)
from tessellm.errors import ConfigError

GOLDEN = [
    # (format, output, expected content, expected [(name, arguments)])
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
             '"Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": '
             '{}}\n</tool_call>',
     "Let me check.\n", [("get_weather", '{"city": "Paris", "unit": "c"}'), ("time", "{}")]),
    (HERMES, '<tool_call>\n{"arguments": {"q": "a \\"}\\" b"}, "name": "search"}\n</tool_call>',
     None, [("search", '{"q": "a \\"}\\" b"}')]),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None,
     [("f", '{"x": 1}')]),
    (HERMES, "No tools needed: 2 < 3, and <tool is not a marker.", "No tools needed: 2 < 3, "
     "and <tool is not a marker.", []),
    (HERMES, "<tool_call>\nnot json at all\n</tool_call>", "<tool_call>\nnot json at all\n"
     "</tool_call>", []),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "x", '
                  '"parameters": {"a": [1, 2, {"b": null}]}}',
     None, [("get_weather", '{"city": "Paris"}'), ("x", '{"a": [1, 2, {"b": null}]}')]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "f", "parameters": {}}', None, [("f", "{}")]),
    (LLAMA3_JSON, "  The answer is {not a call}.", "The answer is {not a call}.", []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "a", "arguments": {"x": "]}\\\\"}}, {"name": "b", '
              '"arguments": {"y": 2.5e3}}]',
     None, [("a", '{"x": "]}\\\\"}'), ("b", '{"y": 2.5e3}')]),
    (MISTRAL, "Sure. [TOOL_CALLS] nope", "Sure. [TOOL_CALLS] nope", []),
]


def _replay(fmt, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list]:
    stream = fmt.stream(lambda: "call_X")
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    names = {e.index: e.name for e in events if isinstance(e, CallStarted)}
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ArgumentsDelta):
            assert e.index in names, "arguments before the call's name"
            args[e.index] = args.get(e.index, "") + e.text
    return content, [(names[i], args.get(i, "")) for i in sorted(names)], events


@pytest.mark.parametrize("fmt,text,content,calls", GOLDEN,
                         ids=[f"{g[0].name}-{i}" for i, g in enumerate(GOLDEN)])
def test_golden_output_whole_and_split_at_every_boundary(fmt, text, content, calls):
    whole = fmt.parse_calls(text, make_id=lambda: "call_X")
    assert (whole.content.strip() if whole.content else None) == \
        (content.strip() if content else None)
    assert [(c.name, c.arguments) for c in whole.calls] == calls and whole.complete
    for c in whole.calls:
        json.loads(c.arguments)
    for cut in range(len(text) + 1):
        got_content, got_calls, _ = _replay(fmt, [text[:cut], text[cut:]])
        assert got_calls == calls, cut
        assert got_content.strip() == (content or "").strip(), cut
    for step in (1, 3):   # and as a stream of tiny deltas
        got_content, got_calls, _ = _replay(fmt, [text[i:i + step]
                                                  for i in range(0, len(text), step)])
        assert got_calls == calls and got_content.strip() == (content or "").strip()


def test_a_call_name_is_sent_before_its_arguments_and_arguments_stream_in_pieces():
    text = '<tool_call>\n{"name": "f", "arguments": {"text": "' + "word " * 20 + '"}}\n'
    _, calls, events = _replay(HERMES, [text[i:i + 4] for i in range(0, len(text), 4)])
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "CallStarted" and kinds.count("ArgumentsDelta") > 10


def test_an_output_cut_inside_a_call_is_incomplete():
    parsed = HERMES.parse_calls('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
                                '</tool_call>\n<tool_call>\n{"name": "g", "argu')
    assert [c.name for c in parsed.calls] == ["f"] and not parsed.complete


def test_the_format_a_template_implies():
    assert choose_format("... {{ '<tool_call>' }} ...") is HERMES
    assert choose_format("{% if x %}<|python_tag|>{% endif %}") is LLAMA3_JSON
    assert choose_format("[AVAILABLE_TOOLS] ...") is MISTRAL
    assert choose_format("{{ messages }}") is HERMES   # the generic prompt's format
    assert choose_format(None, "mistral") is MISTRAL
    with pytest.raises(ConfigError, match="unknown tool-call parser"):
        choose_format(None, "nope")


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    from transformers import AutoTokenizer
    from hf_fixtures import TOKENIZERS
    hf = AutoTokenizer.from_pretrained(str(TOKENIZERS / "qwen3"))
    from tessellm.constraints.guidance_tokenizer import guidance_tokenizer
    return hf, guidance_tokenizer(hf, 151936, [hf.eos_token_id])


TOOLS = [ToolSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"], "additionalProperties": False}),
    ToolSpec("time", {"type": "object", "properties": {}})]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_forcing_grammar_takes_valid_calls_only(qwen3_tokenizer, fmt, parallel):
    from tessellm.tools.tool_plan import token_marker
    hf, lt = qwen3_tokenizer
    grammar = LLMatcher.grammar_from_lark(fmt.grammar(TOOLS, parallel, token_marker(hf)))
    assert LLMatcher.validate_grammar(grammar, lt) == ""
    key = fmt.arguments_keys[0]

    def call(name: str, args: dict) -> str:
        return json.dumps({"name": name, key: args})

    def spelled(calls: list[str]) -> str:
        if fmt is HERMES:
            return "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
        if fmt is MISTRAL:
            return "[TOOL_CALLS] [" + ", ".join(calls) + "]"
        return "; ".join(calls)

    def accepted(text: str) -> bool:
        m = LLMatcher(lt, grammar)
        return m.consume_tokens(hf.encode(text)) and m.is_accepting()

    one = call("get_weather", {"city": "Paris", "days": 3})
    assert accepted(spelled([one]))
    assert fmt.parse_calls(spelled([one])).calls[0].name == "get_weather"
    assert accepted(spelled([one, call("time", {})])) == parallel
    assert not accepted(spelled([call("get_weather", {"days": 3})]))          # required city
    assert not accepted(spelled([call("get_weather", {"city": "P", "days": 9})]))   # maximum
    assert not accepted(spelled([call("unknown", {})]))
