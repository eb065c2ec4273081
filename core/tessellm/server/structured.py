"""From a request's structured-output fields to one StructuredOutputs, checked before admission.

At most one of them may constrain a request: `response_format` (json_object, json_schema),
`structured_outputs`, one `guided_*` field, or a forced tool call (tool_choice "required" or a
named function: the caller passes that one in). `{"type": "text"}` constrains nothing. The
spec is compiled by the server's validate-only GrammarCompiler (an LRU keyed by the canonical
text, so a burst with one schema compiles once) on the tokenizer thread; an invalid one is a
400 whose `param` names the field the client used.
"""
from __future__ import annotations

from tessellm.constraints.structured_outputs import StructuredOutputs
from tessellm.errors import InvalidRequestError
from tessellm.server.protocol import SamplingFields


def _requested(req: SamplingFields) -> list[tuple[str, dict]]:
    """(param, StructuredOutputs fields) of every constraint the request sets."""
    out = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        out.append(("response_format.json_schema.schema", {"json": rf.json_schema.schema_}))
    so = req.structured_outputs
    if so is not None:
        fields = {"json": so.json_, "json_object": so.json_object, "regex": so.regex,
                  "choice": so.choice, "grammar": so.grammar,
                  "disable_any_whitespace": so.disable_any_whitespace}
        out.append(("structured_outputs", {k: v for k, v in fields.items()
                                           if v is not None}))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            out.append((name, {kind: value}))
    return out


def structured_outputs_of(req: SamplingFields, forced: StructuredOutputs | None = None,
                          forced_param: str = "tool_choice"
                          ) -> tuple[StructuredOutputs | None, str | None]:
    """(the request's one constraint or None, the param it came from); InvalidRequestError
    when several are set or one is malformed."""
    asked = _requested(req)
    if forced is not None:
        asked.append((forced_param, {}))
    if len(asked) > 1:
        raise InvalidRequestError(f"a request may constrain its output one way only; this one "
                                  f"sets {', '.join(p for p, _ in asked)}", asked[1][0])
    if forced is not None:
        return forced, forced_param
    if not asked:
        return None, None
    param, fields = asked[0]
    try:
        return StructuredOutputs(**fields), param
    except InvalidRequestError as e:
        raise InvalidRequestError(str(e), param) from None
