"""Tools in the prompt: a template that renders tools is told apart from one that does not
(Qwen3's does, SmolLM2's does not), and the generic prompt carries the tools and writes the
history's calls and results in the Hermes format."""
from __future__ import annotations

import json

from tessellm.engine.chat_template import render_chat
from tessellm.tools.tool_prompt import (generic_messages, native_messages,
                                        template_renders_tools)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "22 C, sunny", "tool_call_id": "call_1"},
]


def _renderer(tokenizer, template=None):
    template = template or tokenizer.chat_template

    def render(messages, tools):
        return render_chat(tokenizer, messages, template, tools=tools)
    return render


def test_qwen3_renders_tools_and_its_history():
    from hf_fixtures import qwen3_tokenizer
    tok = qwen3_tokenizer()
    render = _renderer(tok)
    assert template_renders_tools(render)
    text = render(native_messages(HISTORY), TOOLS)
    assert '"name": "get_weather"' in text and "<tool_response>\n22 C, sunny" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


def test_a_template_without_tools_gets_the_generic_prompt(stories_dir):
    from tessellm.models.source_tokenizer import load_tokenizer
    from server_fixtures import CHAT_TEMPLATE
    tok = load_tokenizer(stories_dir)
    render = _renderer(tok, CHAT_TEMPLATE)
    assert not template_renders_tools(render)
    messages = generic_messages(HISTORY, TOOLS)
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert json.dumps(TOOLS[0]) in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": '
                           '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert messages[3] == {"role": "user",
                           "content": "<tool_response>\n22 C, sunny\n</tool_response>"}
    merged = generic_messages([{"role": "system", "content": "Be brief."}, *HISTORY], TOOLS)
    assert merged[0]["content"].startswith("Be brief.\n\n") and len(merged) == 4
    assert generic_messages(HISTORY, [])[0] == HISTORY[0]   # no tools: no instructions
