"""Structured outputs, logit_bias, echo and tool calling through the unmodified `openai` client,
against `tessellm serve` of a random-weight Qwen3 with the real Qwen3 tokenizer and chat
template (which renders tools, so tool calls use its Hermes-style `<tool_call>` tokens). At
temperature 1 a random model writes noise: only the constraint keeps the output valid."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from openai import OpenAI
from server_fixtures import assert_error_body, request, running_server, wait_idle

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "population": {"type": "integer", "minimum": 0, "maximum": 10 ** 7},
    "tags": {"type": "array", "items": {"enum": ["big", "old", "new"]}, "maxItems": 3}},
    "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, qwen3_random_dir):
    with running_server(tmp_path_factory.mktemp("server-structured"),
                        ["--model", str(qwen3_random_dir), "--dtype", "float32",
                         "--kernel-selection", "first", "--threads", "1",
                         "--max-num-seqs", "8"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _chat(client, **kwargs):
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=kwargs.pop("messages", ASK), **kwargs)


def test_json_schema_response_format_validates_streamed_or_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA,
                                                  "strict": True}}
    out = _chat(client, response_format=fmt, temperature=1.0, seed=3, n=3, max_tokens=200)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = _chat(client, response_format=fmt, temperature=1.0, seed=3, max_tokens=200,
                   stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content


def test_json_object_and_the_vllm_fields(client):
    out = _chat(client, response_format={"type": "json_object"}, temperature=0,
                max_tokens=120, extra_body={"top_k": 20})
    model = client.models.list().data[0].id
    assert out.choices[0].finish_reason in ("stop", "length")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    cases = [({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
             ({"structured_outputs": {"choice": ["alpha", "beta"]}}, "alpha|beta"),
             ({"guided_regex": "(ab)+c"}, "(ab)+c"),
             ({"guided_choice": ["x1", "y2"]}, "x1|y2"),
             ({"guided_grammar": 'root ::= "<" [0-9] [0-9]? ">"'}, "<[0-9]{1,2}>"),
             ({"structured_outputs": {"grammar": 'start: "[" /[a-z]{1,4}/ "]"'}},
              r"\[[a-z]{1,4}\]")]
    for body, pattern in cases:
        out = client.completions.create(model=model, prompt="Say:", max_tokens=40,
                                        temperature=1.0, seed=1, extra_body=body)
        assert re.fullmatch(pattern, out.choices[0].text), (body, out.choices[0].text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    out = client.completions.create(model=model, prompt="JSON:", max_tokens=60, temperature=1,
                                    extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(out.choices[0].text), schema)


def test_logit_bias_and_echo(client):
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=1.0,
                                    logit_bias={"15": 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == "0000"   # token 15 is "0"
    out = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                    logit_bias={"15": -100, "16": 100})
    assert out.choices[0].text == "111"
    plain = client.completions.create(model=model, prompt="Once upon", max_tokens=5,
                                      temperature=0)
    echoed = client.completions.create(model=model, prompt="Once upon", max_tokens=5,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon" + plain.choices[0].text
    stream = client.completions.create(model=model, prompt=["Once upon", "A"], max_tokens=5,
                                       temperature=0, echo=True, stream=True)
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts[0] == echoed.choices[0].text and texts[1].startswith("A")


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_valid_calls(client, choice):
    out = _chat(client, tools=[WEATHER, CLOCK], tool_choice=choice, temperature=1.0, seed=5,
                n=3, max_tokens=200, parallel_tool_calls=False)
    for c in out.choices:
        assert c.finish_reason == "tool_calls", c.message
        [(name, args)] = _calls(c.message)
        assert c.message.tool_calls[0].id.startswith("call_")
        if isinstance(choice, dict):
            assert name == "get_time"
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[name]
        jsonschema.validate(args, tool["function"]["parameters"])


def test_a_streamed_call_reassembles_to_the_whole_one(client):
    kwargs = dict(tools=[WEATHER, CLOCK], tool_choice="required", temperature=1.0, seed=9,
                  max_tokens=200)
    whole = _chat(client, **kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _chat(client, stream=True, **kwargs):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": None, "arguments": "", "id": None})
                if tc.id:
                    assert entry["id"] is None and tc.function.name   # the name comes first
                    entry["id"], entry["name"] = tc.id, tc.function.name
                entry["arguments"] += tc.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_tool_result_turn_renders_and_is_answered(client):
    first = _chat(client, tools=[WEATHER], tool_choice="required", temperature=0,
                  max_tokens=200, parallel_tool_calls=False).choices[0].message
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function",
         "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in first.tool_calls]},
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "22 C, sunny"}]
    answer = _chat(client, messages=history, tools=[WEATHER], temperature=0, max_tokens=16)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > 60


def test_auto_and_none_leave_the_model_free(client):
    for choice in ("auto", "none"):
        out = _chat(client, tools=[WEATHER], tool_choice=choice, temperature=0, max_tokens=8)
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


BAD = [
    ("invalid schema", "/v1/chat/completions",
     {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "objekt"}}}}, "response_format.json_schema.schema"),
    ("json_schema without schema", "/v1/chat/completions",
     {"messages": ASK, "response_format": {"type": "json_schema"}}, "response_format"),
    ("unknown tool name", "/v1/chat/completions",
     {"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                           "function": {"name": "nope"}}},
     "tool_choice"),
    ("required without tools", "/v1/chat/completions",
     {"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    ("non-object parameters", "/v1/chat/completions",
     {"messages": ASK, "tools": [{"type": "function", "function": {
         "name": "f", "parameters": {"type": "string"}}}]}, "tools.0.function.parameters"),
    ("bad tool name", "/v1/chat/completions",
     {"messages": ASK, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools.0.function.name"),
    ("regex that does not compile", "/v1/completions",
     {"prompt": "x", "structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ("grammar that does not compile", "/v1/completions",
     {"prompt": "x", "guided_grammar": "start: foo"}, "guided_grammar"),
    ("two constraints", "/v1/completions",
     {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("two kinds in structured_outputs", "/v1/completions",
     {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("empty choice", "/v1/completions",
     {"prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ("logit_bias out of vocabulary", "/v1/completions",
     {"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("logit_bias out of range", "/v1/completions",
     {"prompt": "x", "logit_bias": {"5": -101}}, "logit_bias.5"),
]


@pytest.mark.parametrize("path,body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_constraints_and_tools_are_400s_naming_the_field(server, path, body, param):
    status, _, answer = request(server, "POST", path, {**body, "max_tokens": 4})
    assert status == 400, answer
    assert assert_error_body(answer)["param"] == param, answer


def test_the_server_serves_on(server, client):
    with pytest.raises(openai.BadRequestError):
        _chat(client, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}})
    assert _chat(client, max_tokens=4, temperature=0).choices[0].finish_reason == "length"
    m = wait_idle(server, timeout=5)
    assert m["tessellm:num_requests_running"] == 0 and m["tessellm:kv_cache_usage_perc"] == 0


def test_echo_with_logprobs_returns_the_prompts_logprobs(client):
    model = client.models.list().data[0].id
    prompt = "The weather in Paris is"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0,
                                    echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3 and "".join(lp.tokens) == out.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed_tokens, streamed_lps = [], []
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=3,
                                           temperature=0, echo=True, logprobs=2, stream=True):
        for c in chunk.choices:
            if c.logprobs:
                streamed_tokens += c.logprobs.tokens
                streamed_lps += c.logprobs.token_logprobs
    assert streamed_tokens == lp.tokens and streamed_lps == lp.token_logprobs
