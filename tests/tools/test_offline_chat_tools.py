"""LLM.chat with tools (the offline side of tool calling, on a random-weight Qwen3 with its real
template): a required call is forced and parsed into `tool_calls`, a named one calls that
function, "none" leaves the text alone, and bad tool arguments are clear errors."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tessellm import LLM, SamplingParams
from tessellm.constraints.structured_outputs import StructuredOutputs
from tessellm.errors import InvalidRequestError

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "noop"}}]
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
PARAMS = SamplingParams(max_tokens=120, temperature=1.0, seed=2)


@pytest.fixture(scope="module")
def llm(qwen3_random_dir):
    return LLM(str(qwen3_random_dir), dtype="float32", kernel_selection="first",
               load_progress=False)


def test_required_and_named_calls_are_forced_and_parsed(llm):
    out = llm.chat([ASK, ASK], PARAMS, tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False)
    for o in out:
        sample = o.outputs[0]
        assert sample.finish_reason == "tool_calls" and len(sample.tool_calls) == 1
        call = sample.tool_calls[0]
        schema = next(t["function"].get("parameters", {"type": "object"}) for t in TOOLS
                      if t["function"]["name"] == call.name)
        jsonschema.validate(json.loads(call.arguments), schema)
    named = llm.chat(ASK, PARAMS, tools=TOOLS, tool_choice={"type": "function",
                                                            "function": {"name": "add"}})
    assert {c.name for c in named[0].outputs[0].tool_calls} == {"add"}
    plain = llm.chat(ASK, SamplingParams(max_tokens=5, temperature=0), tools=TOOLS,
                     tool_choice="none")[0].outputs[0]
    assert plain.tool_calls is None and plain.finish_reason in ("stop", "length")


@pytest.mark.parametrize("kwargs,param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "sub"}}),
     "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "x", "parameters": {
        "type": "array"}}}]), "tools.0.function.parameters"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), "tools"),
    (dict(tools=TOOLS, tool_choice="always"), "tool_choice"),
])
def test_bad_tool_arguments_are_clear_errors(llm, kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        llm.chat(ASK, PARAMS, **kwargs)
    assert err.value.param == param


def test_a_forced_call_and_another_constraint_conflict(llm):
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="a+"))
    with pytest.raises(InvalidRequestError, match="cannot both"):
        llm.chat(ASK, params, tools=TOOLS, tool_choice="required")
