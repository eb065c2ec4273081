"""Granite's tool calls for tessellm (the tessellm_tool_call_formats hook).

IBM Granite 3.x models answer a tool call with `<|tool_call|>` and a JSON array of calls,
`[{"name": ..., "arguments": {...}}]`. One CallFormat describes it: the server then parses
such outputs into OpenAI `tool_calls` (whole and streamed), and forces them with a grammar
when `tool_choice` is "required" or names a function. It is chosen for a chat template that
contains the marker, or by `tessellm serve --tool-call-parser granite`.
"""
from __future__ import annotations

from tessellm.plugin_api import CallFormat, hookimpl

TESSELLM_API_VERSION = "1.5"

GRANITE = CallFormat("granite", start="<|tool_call|>", array=True,
                     template_markers=("<|tool_call|>",))


@hookimpl
def tessellm_tool_call_formats() -> list[CallFormat]:
    return [GRANITE]
