"""What `tools` and `tool_choice` mean for one chat request (ToolPlan).

- no tools, or tool_choice "none": the output is plain content; tools are not rendered, and a
  history with tool turns is still rendered as the template (or the generic prompt) reads it;
- "auto" (the default with tools): the tools are rendered, the model chooses, and its output is
  parsed for calls in the chat template's format (tools.formats);
- "required" / a named function: the same, and the output is forced by a grammar to be one call
  (or, with parallel_tool_calls, one or more) of the listed function(s), with arguments valid
  against their parameters schemas.
A named function that is not among the tools, or "required" / a name without tools, is a 400.
Markers the tokenizer holds as one added token (Qwen's `<tool_call>`) are forced as that token.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tessellm.constraints.structured_outputs import StructuredOutputs
from tessellm.errors import InvalidRequestError
from tessellm.server.protocol import ChatCompletionRequest
from tessellm.tools.call_format import ToolSpec
from tessellm.tools.tool_prompt import generic_messages, native_messages


@dataclass(frozen=True)
class ToolPlan:
    format: Any                           # the CallFormat to parse calls with; None: no tools
    messages: list[dict[str, Any]]        # the history as the template reads it
    template_tools: list[dict[str, Any]] | None   # `tools=` for a template that renders them
    forced: StructuredOutputs | None      # the grammar of a required / named call


def token_marker(tokenizer: Any):
    """marker(text) -> the Lark spelling of a marker: `<[id]>` if it is one added token."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}

    def marker(text: str) -> str:
        token_id = added.get(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)
    return marker


def plan_tools(req: ChatCompletionRequest, renders_tools: bool, fmt: Any, tokenizer: Any
               ) -> ToolPlan:
    messages = req.template_messages()
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice in ("required",) or not isinstance(choice, str):
        if not tools:
            raise InvalidRequestError("tool_choice requires tools, and the request has none",
                                      "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool names must be distinct", "tools")
    if choice == "none" or not tools:
        shown = native_messages(messages) if renders_tools else generic_messages(messages, [])
        return ToolPlan(None, shown, None, None)
    offered = [t.model_dump(exclude_none=True) for t in tools]
    if renders_tools:
        shown, template_tools = native_messages(messages), offered
    else:
        shown, template_tools = generic_messages(messages, offered), None
    forced = None
    if choice != "auto":
        if isinstance(choice, str):   # "required"
            wanted = tools
        else:
            wanted = [t for t in tools if t.function.name == choice.function.name]
            if not wanted:
                raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is "
                                          f"not among the tools ({', '.join(names)})",
                                          "tool_choice")
        specs = [ToolSpec(t.function.name, t.function.parameters_schema) for t in wanted]
        forced = StructuredOutputs(grammar=fmt.grammar(specs, req.parallel_tool_calls,
                                                       token_marker(tokenizer)))
    return ToolPlan(fmt, shown, template_tools, forced)
