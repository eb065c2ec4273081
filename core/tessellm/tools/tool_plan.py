"""What `tools` and `tool_choice` mean for one chat request (ToolPlan), for the server and the
offline LLM.chat alike (plain OpenAI-shaped dicts in, the history to render and the
constraint out).

- no tools, or tool_choice "none": the output is plain content; tools are not rendered, and a
  history with tool turns is still rendered as the template (or the generic prompt) reads it;
- "auto" (the default with tools): the tools are rendered, the model chooses, and its output is
  parsed for calls in the chat template's format (tools.formats);
- "required" / a named function (`{"type": "function", "function": {"name": ...}}`): the same,
  and the output is forced by a grammar to be one call (or, with parallel_tool_calls, one or
  more) of the listed function(s), with arguments valid against their parameters schemas.
A named function that is not among the tools, "required" or a name without tools, a tool that
is not `{"type": "function", "function": {"name", ...}}`, duplicate names, or parameters that
are not an object schema: InvalidRequestError naming the field. Markers the tokenizer holds as
one added token (Qwen's `<tool_call>`) are forced as that token.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tessellm.constraints.structured_outputs import StructuredOutputs
from tessellm.errors import InvalidRequestError
from tessellm.tools.call_format import ToolSpec
from tessellm.tools.formats import choose_format
from tessellm.tools.tool_prompt import generic_messages, native_messages, template_renders_tools

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class ToolPlan:
    format: Any                           # the CallFormat to parse calls with; None: no tools
    messages: list[dict[str, Any]]        # the history as the template reads it
    template_tools: list[dict[str, Any]] | None   # `tools=` for a template that renders them
    forced: StructuredOutputs | None      # the grammar of a required / named call


def tool_setup(render: Callable[..., str], template: str | None, parser: str | None,
               extra_formats: Sequence[Any] = ()) -> tuple[bool, Any]:
    """(whether the chat template renders tools, the tool-call format): the format `parser`
    names, else the one a tool-rendering template implies, else the generic prompt's.
    `render(messages, tools)` renders with the template."""
    renders = template is not None and template_renders_tools(render)
    return renders, choose_format(template if renders else None, parser, extra_formats)


def token_marker(tokenizer: Any):
    """marker(text) -> the Lark spelling of a marker: `<[id]>` if it is one added token."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}

    def marker(text: str) -> str:
        token_id = added.get(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)
    return marker


def tool_specs(tools: Sequence[Mapping[str, Any]]) -> list[ToolSpec]:
    """Each tool's name and parameters schema, checked (see the module docstring)."""
    specs = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" \
                or not isinstance(fn, Mapping):
            raise InvalidRequestError("a tool must be {'type': 'function', 'function': {...}}",
                                      f"tools.{i}")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise InvalidRequestError(f"a function name must match {TOOL_NAME.pattern}, got "
                                      f"{name!r}", f"tools.{i}.function.name")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise InvalidRequestError("a function's parameters must be a JSON schema of type "
                                      "object", f"tools.{i}.function.parameters")
        specs.append(ToolSpec(name, dict(params)))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool names must be distinct", "tools")
    return specs


def plan_tools(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
               tool_choice: Any, parallel_tool_calls: bool, renders_tools: bool, fmt: Any,
               tokenizer: Any) -> ToolPlan:
    tools = list(tools or [])
    specs = tool_specs(tools)
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    named = None
    if isinstance(choice, Mapping):
        named = (choice.get("function") or {}).get("name") \
            if choice.get("type") == "function" else None
        if not isinstance(named, str):
            raise InvalidRequestError("a named tool_choice is {'type': 'function', 'function': "
                                      "{'name': ...}}", "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequestError(f"tool_choice must be none, auto, required or a named "
                                  f"function, got {choice!r}", "tool_choice")
    if (choice == "required" or named is not None) and not tools:
        raise InvalidRequestError("tool_choice requires tools, and the request has none",
                                  "tool_choice")
    if choice == "none" or not tools:
        shown = native_messages(messages) if renders_tools else generic_messages(messages, [])
        return ToolPlan(None, shown, None, None)
    if renders_tools:
        shown, template_tools = native_messages(messages), [dict(t) for t in tools]
    else:
        shown, template_tools = generic_messages(messages, tools), None
    forced = None
    if choice != "auto":
        wanted = specs if named is None else [s for s in specs if s.name == named]
        if not wanted:
            raise InvalidRequestError(f"tool_choice names {named!r}, which is not among the "
                                      f"tools ({', '.join(s.name for s in specs)})",
                                      "tool_choice")
        forced = StructuredOutputs(grammar=fmt.grammar(wanted, parallel_tool_calls,
                                                       token_marker(tokenizer)))
    return ToolPlan(fmt, shown, template_tools, forced)
