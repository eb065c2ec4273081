"""CallFormat: how one model family writes tool calls, parsed incrementally, and forced.

A format is content text, then calls, each a JSON object with the function's name and its
arguments (an object, under one of `arguments_keys`):
- `start`: the marker that opens calls (Hermes / Qwen `<tool_call>`, Mistral `[TOOL_CALLS]`,
  Llama's optional `<|python_tag|>`); `end`: the marker closing each call (`</tool_call>`);
- `array`: the calls after the marker are one JSON array (Mistral);
- `bare_json`: an output that starts with `{` is calls without any marker (Llama 3.x), and
  `separator` (";") may join several.

ToolCallStream parses a growing output: `feed(delta)` returns the events it decides —
ContentDelta (text outside calls), CallStarted (index, id, name: sent as soon as the name is
complete), ArgumentsDelta (index, the next piece of the arguments' JSON text, exactly as the
model wrote it) — and `finish()` the rest. A text that may still become a marker is held back
until decided. `parse_calls(text)` is the same parser run once over a whole output, so a
streamed call reassembles to the whole one by construction (arguments are the model's own JSON
text, never re-serialized). After the first call, whitespace-only content is dropped.
`CallFormat.grammar(tools, parallel, marker)` is the Lark grammar (llguidance dialect) whose
outputs are exactly well-formed calls of the given tools, arguments valid against each tool's
parameters schema: what `tool_choice` "required" or a named function enforces.
"""
from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tessellm.constraints.structured_outputs import JSON_WHITESPACE
from tessellm.tools.json_spans import JSONSpanError, object_members, skip_ws, value_end

_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function a request offers: its name and its parameters' JSON schema."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str   # the JSON text of the arguments object


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


Event = ContentDelta | CallStarted | ArgumentsDelta


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None    # text outside calls (None when only whitespace)
    calls: list[ToolCall]
    complete: bool         # False: the output ended inside a call


@dataclass(frozen=True)
class CallFormat:
    name: str
    start: str | None = None
    end: str | None = None
    array: bool = False
    bare_json: bool = False
    separator: str | None = None
    arguments_keys: tuple[str, ...] = ("arguments",)
    template_markers: tuple[str, ...] = ()   # a chat template containing one implies this

    def stream(self, make_id: Callable[[], str] = new_call_id) -> ToolCallStream:
        return ToolCallStream(self, make_id)

    def parse_calls(self, text: str, make_id: Callable[[], str] = new_call_id) -> ParsedOutput:
        stream = self.stream(make_id)
        events = stream.feed(text) + stream.finish()
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        return ParsedOutput(content if content.strip() else None, list(stream.calls),
                            not stream.incomplete)

    def matches_template(self, template: str) -> bool:
        return any(m in template for m in self.template_markers)

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool,
                marker: Callable[[str], str]) -> str:
        """The Lark grammar of one (or, `parallel`, one or more) calls of `tools`; `marker`
        spells a marker (a quoted literal, or `<[id]>` where the tokenizer has it as one
        token)."""
        key = self.arguments_keys[0]
        variants = [{"type": "object", "properties": {"name": {"const": t.name},
                                                      key: t.parameters},
                     "required": ["name", key], "additionalProperties": False} for t in tools]
        call = variants[0] if len(variants) == 1 else {"anyOf": variants}
        options = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
        if self.array:
            items = {"type": "array", "items": call, "minItems": 1, **options}
            if not parallel:
                items["maxItems"] = 1
            return (f"start: {marker(self.start or '')} \" \"? calls\n"
                    f"calls: %json {json.dumps(items)}\n")
        one = f"call: %json {json.dumps({**call, **options})}\n"
        if self.start and self.end:
            block = f'{marker(self.start)} "\\n" call "\\n" {marker(self.end)}'
            rest = ' ("\\n" block)*' if parallel else ""
            return f"start: block{rest}\nblock: {block}\n{one}"
        joiner = json.dumps((self.separator or ";") + " ")
        rest = f" ({joiner} call)*" if parallel else ""
        return f"start: call{rest}\n{one}"


@dataclass(slots=True)
class _Partial:
    """The call being parsed: where its object starts and what was sent of it."""

    start: int
    index: int
    id: str
    name: str | None = None
    args_sent: int = -1   # index in text up to which the arguments were sent (-1: none yet)


@dataclass
class ToolCallStream:
    fmt: CallFormat
    make_id: Callable[[], str] = new_call_id
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    incomplete: bool = False
    _pos: int = 0
    _mode: str = ""                 # "start" | "content" | "calls" | "after_call" | "done"
    _array_open: bool = False
    _marker_at: int = -1            # where the marker of the current block began
    _partial: _Partial | None = None

    def __post_init__(self) -> None:
        self._mode = "start" if self.fmt.bare_json else "content"

    def feed(self, delta: str) -> list[Event]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> list[Event]:
        events = self._advance(final=True)
        if self._partial is not None:
            self.incomplete = True
        return events

    # ---- the state machine -----------------------------------------------------------

    def _content(self, out: list[Event], end: int) -> None:
        piece = self.text[self._pos:end]
        if piece and not (self.calls and not piece.strip()):
            out.append(ContentDelta(piece))
        self._pos = end

    def _advance(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            mode = self._mode
            if mode == "start":
                if not self._decide_start(final):
                    return out
            elif mode == "content":
                if not self._scan_content(out, final):
                    return out
            elif mode == "calls":
                if not self._scan_call(out, final):
                    return out
            elif mode == "after_call":
                if not self._after_call(final):
                    return out
            else:   # "done": the rest is content
                self._content(out, len(self.text))
                return out

    def _decide_start(self, final: bool) -> bool:
        """bare_json formats: calls if the output opens with `{` or the start marker."""
        j = skip_ws(self.text, 0)
        rest = self.text[j:]
        marker = self.fmt.start
        if marker and rest.startswith(marker):
            self._marker_at, self._pos, self._mode = j, j + len(marker), "calls"
        elif marker and marker.startswith(rest) and not final:
            return False   # maybe the marker: wait (also while only whitespace came)
        elif rest.startswith("{"):
            self._marker_at, self._pos, self._mode = j, j, "calls"
        elif not rest and not final:
            return False
        else:
            self._mode = "done"
        return True

    def _scan_content(self, out: list[Event], final: bool) -> bool:
        marker = self.fmt.start
        if not marker:
            self._mode = "done"
            return True
        idx = self.text.find(marker, self._pos)
        if idx >= 0:
            self._content(out, idx)
            self._marker_at, self._pos, self._mode = idx, idx + len(marker), "calls"
            self._array_open = False
            return True
        hold = 0 if final else _held_back(self.text, self._pos, marker)
        self._content(out, len(self.text) - hold)
        return False

    def _not_a_call(self) -> None:
        """What followed a marker is not a call: from the marker on, it is content."""
        self._partial = None
        self._pos = self._marker_at
        self._mode = "done"

    def _scan_call(self, out: list[Event], final: bool) -> bool:
        text = self.text
        j = skip_ws(text, self._pos)
        if j >= len(text):
            return False
        if self.fmt.array and not self._array_open:
            if text[j] != "[":
                self._not_a_call()
                return True
            self._array_open, self._pos = True, j + 1
            return True
        if self.fmt.array and self._partial is None and text[j] in ",]":
            if text[j] == "]":
                self._pos, self._mode = j + 1, "content"
            elif not self.calls:
                self._not_a_call()
            else:
                self._pos = j + 1
            return True
        if text[j] != "{":
            self._not_a_call()
            return True
        if self._partial is None:
            self._partial = _Partial(j, len(self.calls), self.make_id())
        p = self._partial
        try:
            end = value_end(text, p.start)
            members = list(object_members(text, p.start))
        except (JSONSpanError, ValueError):
            self._not_a_call()
            return True
        args_span = None
        for key, v_start, v_end in members:
            if key == "name" and v_end is not None and p.name is None:
                name = json.loads(text[v_start:v_end])
                if not isinstance(name, str):
                    self._not_a_call()
                    return True
                p.name = name
                out.append(CallStarted(p.index, p.id, name))
            elif key in self.fmt.arguments_keys:
                args_span = (v_start, v_end)
        if p.name is not None and args_span is not None and text[args_span[0]] != '"':
            upto = args_span[1] if args_span[1] is not None else len(text)
            start = args_span[0] if p.args_sent < 0 else p.args_sent
            if upto > start:
                out.append(ArgumentsDelta(p.index, text[start:upto]))
                p.args_sent = upto
        if end is None:
            if final:
                self.incomplete = True
            return False
        arguments = "{}" if args_span is None else text[args_span[0]:args_span[1]]
        if arguments.startswith('"'):   # arguments written as a JSON string of JSON
            arguments = json.loads(arguments)
            if p.name is not None:
                out.append(ArgumentsDelta(p.index, arguments))
        elif args_span is None and p.name is not None:
            out.append(ArgumentsDelta(p.index, arguments))
        if p.name is None:
            self._not_a_call()
            return True
        self.calls.append(ToolCall(p.id, p.name, arguments))
        self._partial, self._pos, self._mode = None, end, "after_call"
        self._marker_at = end   # what follows is judged on its own
        return True

    def _after_call(self, final: bool) -> bool:
        text, fmt = self.text, self.fmt
        j = skip_ws(text, self._pos)
        if fmt.array:
            self._mode = "calls"
            return True
        for closer in (fmt.end, fmt.separator):
            if not closer:
                continue
            rest = text[j:]
            if rest.startswith(closer):
                self._pos = j + len(closer)
                self._mode = "content" if closer == fmt.end else "calls"
                if closer == fmt.separator:
                    self._marker_at = self._pos
                return True
            if closer.startswith(rest) and not final:
                return False   # the closer may still be coming
        self._mode = "content" if fmt.start and not fmt.bare_json else "done"
        return True


def _held_back(text: str, pos: int, marker: str) -> int:
    """Length of the longest end of text[pos:] that is a proper prefix of `marker`."""
    tail = text[max(pos, len(text) - len(marker) + 1):]
    for k in range(len(tail), 0, -1):
        if marker.startswith(tail[-k:]):
            return k
    return 0
