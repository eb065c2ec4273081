"""The built-in tool-call formats and how one is chosen.

- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call (Hermes,
  Qwen2.5 / Qwen3, and tessellm's generic tool prompt);
- llama3_json: the output is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`; several joined by ";"), as Llama 3.1 / 3.2 call tools;
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.
`choose_format(template, name, extra)`: the format `name` (the server's --tool-call-parser),
else the first whose markers the chat template contains, else hermes (the generic prompt's).
`extra` are third-party formats from the `tessellm_tool_call_formats` plugin hook (anything
with CallFormat's methods: name, stream, parse_calls, matches_template, grammar); they are
consulted after the built-in ones when matching a template.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessellm.errors import ConfigError
from tessellm.tools.call_format import CallFormat

HERMES = CallFormat("hermes", start="<tool_call>", end="</tool_call>",
                    template_markers=("<tool_call>",))
LLAMA3_JSON = CallFormat("llama3_json", start="<|python_tag|>", bare_json=True, separator=";",
                         arguments_keys=("parameters", "arguments"),
                         template_markers=("<|python_tag|>",))
MISTRAL = CallFormat("mistral", start="[TOOL_CALLS]", array=True,
                     template_markers=("[TOOL_CALLS]", "[AVAILABLE_TOOLS]"))
BUILTIN_FORMATS = (MISTRAL, LLAMA3_JSON, HERMES)   # template matching order
GENERIC_FORMAT = HERMES   # what the generic tool prompt asks for


def all_formats(extra: Sequence[Any] = ()) -> dict[str, Any]:
    return {f.name: f for f in (*BUILTIN_FORMATS, *extra)}


def choose_format(template: str | None, name: str | None = None,
                  extra: Sequence[Any] = ()) -> Any:
    formats = all_formats(extra)
    if name is not None:
        if name not in formats:
            raise ConfigError(f"unknown tool-call parser {name!r}; known: "
                              f"{', '.join(sorted(formats))}")
        return formats[name]
    for fmt in formats.values():
        if template and fmt.matches_template(template):
            return fmt
    return GENERIC_FORMAT
