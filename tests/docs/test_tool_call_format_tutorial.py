"""The tool-call tutorial's plugin (docs/examples/tool_call_format) adds Granite's format: the
plugin manager offers it, a template with its marker chooses it, it parses Granite outputs
(whole and streamed) and its grammar forces valid calls."""
from __future__ import annotations

import importlib.metadata

from llguidance import LLMatcher

from docs_paths import EXAMPLES
from tessellm.plugin_spec import ENTRY_POINT_GROUP
from tessellm.plugins import PluginManager
from tessellm.tools.call_format import ToolSpec
from tessellm.tools.formats import choose_format

OUTPUT = ('I will look it up.<|tool_call|>[{"name": "get_weather", "arguments": '
          '{"city": "Rome"}}]')


def test_the_tutorial_plugin_adds_granite_calls(on_sys_path) -> None:
    on_sys_path(EXAMPLES / "tool_call_format" / "src")
    tutorial = importlib.metadata.EntryPoint(name="granite_tools",
                                             value="tessellm_granite_tools.plugin",
                                             group=ENTRY_POINT_GROUP)
    manager = PluginManager([tutorial]).load()
    formats = manager.tool_call_formats()
    assert [f.name for f in formats] == ["granite"]
    record = next(r for r in manager.records if r.name == "granite_tools")
    assert record.status == "loaded" and record.error is None
    fmt = choose_format("{{- '<|tool_call|>' + tool_calls | tojson }}", extra=formats)
    parsed = fmt.parse_calls(OUTPUT)
    assert parsed.content == "I will look it up."
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Rome"}')]
    stream = fmt.stream()
    events = [e for ch in OUTPUT for e in stream.feed(ch)] + stream.finish()
    assert [c.arguments for c in stream.calls] == ['{"city": "Rome"}'] and events
    tools = [ToolSpec("get_weather", {"type": "object", "properties": {"city": {
        "type": "string"}}, "required": ["city"]})]
    grammar = LLMatcher.grammar_from_lark(fmt.grammar(tools, False, lambda m: f'"{m}"'))
    assert LLMatcher.validate_grammar(grammar) == ""
