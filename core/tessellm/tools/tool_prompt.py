"""Tools and tool turns in a chat prompt.

A chat template that renders tools (Qwen2.5 / Qwen3, Llama 3.1+, Mistral, Hermes) gets them as
`tools=` and the history as it expects it: an assistant turn's `tool_calls` with their
arguments as objects (OpenAI sends JSON text), `tool` turns as they are. A template that knows
no tools (it renders the same text with and without them: `template_renders_tools`) gets the
generic prompt instead: the tools as JSON in a system message with the Hermes call format
(tools.formats.GENERIC_FORMAT), assistant calls written back as `<tool_call>` blocks and tool
results as `<tool_response>` blocks in user turns.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

PROBE_TOOL = {"type": "function", "function": {
    "name": "tessellm_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}

GENERIC_INSTRUCTIONS = (
    "You can call functions to help with the user's request. The functions, as JSON "
    "schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one block per call, and nothing else:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n"
    "</tool_call>\n"
    "Function results come back inside <tool_response></tool_response>.")


def template_renders_tools(render: Callable[..., str]) -> bool:
    """Whether a template shows tools: `render(messages, tools)` differs with and without."""
    probe = [{"role": "user", "content": "hi"}]
    try:
        return render(probe, [PROBE_TOOL]) != render(probe, None)
    except Exception:   # a template that raises on tools does not render them
        return False


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def native_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The history for a template that renders tools: call arguments as objects."""
    out = []
    for m in messages:
        d = dict(m)
        if d.get("tool_calls"):
            d["tool_calls"] = [
                {**call, "function": {**call["function"],
                                      "arguments": _arguments_object(call["function"]
                                                                     .get("arguments"))}}
                for call in d["tool_calls"]]
        out.append(d)
    return out


def _call_block(call: Mapping[str, Any]) -> str:
    fn = call["function"]
    body = {"name": fn["name"], "arguments": _arguments_object(fn.get("arguments") or "{}")}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def generic_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
                     ) -> list[dict[str, Any]]:
    """The history for a template that knows no tools (see the module docstring); with no
    `tools`, only the history's tool turns are rewritten (no instructions)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = "\n".join(_call_block(c) for c in m["tool_calls"])
            out.append({"role": "assistant",
                        "content": f"{content}\n{blocks}" if content else blocks})
        elif role == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if not tools:
        return out
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    instructions = GENERIC_INSTRUCTIONS.format(tools=listing)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out
