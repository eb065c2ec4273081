"""A catalogue of hostile and unlucky requests, each with the answer a server must give.

Used by the server tests (each one, then: nothing left waiting or running, no KV block used,
a normal request answered) and by `tessellm bench soak` (mixed into ordinary traffic). Every
entry is the raw bytes of one HTTP request (testing.raw_http) so that nothing a client library
would refuse to send is out of reach. `hostile_requests(max_queue, api_key)` fits the entries
to a server's configuration (its queue limit, its key).
"""
from __future__ import annotations

from dataclasses import dataclass

from tessellm.sampling_params import MAX_STOP_STRINGS
from tessellm.testing.raw_http import build_request

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {"prompt": "Once upon a time", "max_tokens": 3}
CHAT_BASE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@dataclass(frozen=True, slots=True)
class HostileRequest:
    name: str
    raw: bytes
    status: int               # what the server must answer
    fragment: str = ""        # a piece of the error message, when the status is an error
    param: str | None = None  # the error object's `param`, when one is to blame


def _json_with(base: dict, **fields: object) -> bytes:
    """A JSON body: `base` with `fields` spliced in as raw JSON text (so that values JSON
    has no Python spelling for, 1e999 or a lone surrogate escape, can be sent)."""
    import json
    text = json.dumps(base)[:-1]
    for name, raw_value in fields.items():
        text += f', "{name}": {raw_value}'
    return (text + "}").encode()


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "boolean"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"],
                  "additionalProperties": False}
    return schema


def hostile_requests(max_queue: int, api_key: str | None = None) -> list[HostileRequest]:
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def req(name: str, body: bytes | dict | None, status: int, fragment: str = "",
            param: str | None = None, path: str = COMPLETIONS, method: str = "POST",
            headers: dict[str, str | bytes] | None = None) -> HostileRequest:
        return HostileRequest(name, build_request(method, path, body, {**auth, **(headers or {})}),
                              status, fragment, param)

    deep = 5000
    stops = [f"<{i}>" for i in range(MAX_STOP_STRINGS + 1)]
    out = [
        # the requests that once left phantom queue entries behind
        *(req(f"stop-strings-{k}", {**BASE, "stop": stops[:k]}, 200)
          for k in (5, MAX_STOP_STRINGS)),
        req("stop-strings-too-many", {**BASE, "stop": stops}, 400, "at most 16", "stop"),
        req("top-k-beyond-int64", {**BASE, "top_k": 2 ** 70}, 400, "", "top_k"),
        req("stop-token-ids-beyond-int64", {**BASE, "stop_token_ids": [2 ** 70]}, 400, "",
            "stop_token_ids.0"),
        req("stop-token-ids-out-of-vocab", {**BASE, "stop_token_ids": [10 ** 9]}, 400,
            "out of range", "stop_token_ids"),
        req("seed-beyond-int64", {**BASE, "seed": 2 ** 64}, 400, "", "seed"),
        req("priority-beyond-int64", {**BASE, "priority": -(2 ** 70)}, 400, "", "priority"),
        req("n-huge", {**BASE, "n": 10 ** 30}, 400, "", "n"),
        req("max-tokens-huge", {**BASE, "max_tokens": 10 ** 30}, 400, "", "max_tokens"),
        req("prompt-id-huge", {"prompt": [1, 2 ** 80], "max_tokens": 2}, 400, "out of range"),
        # numbers that are not finite
        req("temperature-infinite", _json_with(BASE, temperature="1e999"), 400, "",
            "temperature"),
        req("top-p-infinite", _json_with(BASE, top_p="-1e999"), 400, "", "top_p"),
        req("temperature-nan", _json_with(BASE, temperature="NaN"), 400, "not valid JSON"),
        req("temperature-tiny-is-greedy", {**BASE, "temperature": 1e-38}, 200),
        # text that is not text
        req("prompt-lone-surrogate", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400,
            "surrogate", "prompt"),
        req("chat-lone-surrogate", b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
            400, "surrogate", "messages.0.content", CHAT),
        req("stop-lone-surrogate", _json_with(BASE, stop='["\\ud83d"]'), 400, "surrogate",
            "stop.0"),
        req("emoji-surrogate-pair", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}', 200),
        req("body-not-utf8", b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, "UTF-8"),
        # structure
        req("json-nested-deep", ('{"prompt": ' + "[" * deep + "]" * deep + "}").encode(),
            400, "nests"),
        req("json-invalid", b'{"prompt": "x",', 400, "not valid JSON"),
        req("json-array", b'["x"]', 400, "JSON object"),
        req("unknown-field", {**BASE, "frobnicate": {"a": [1, {"b": 2}]}}, 400, "",
            "frobnicate"),
        req("prompt-wrong-type", {"prompt": {"text": "x"}}, 400, "", "prompt"),
        req("image-content-part", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
            400, "image input", None, CHAT),
        req("too-many-sequences", {"prompt": ["a", "b"], "n": max_queue // 2 + 1,
                                   "max_tokens": 1}, 400, "", "n"),
        # constraints and tools
        req("schema-invalid", {**BASE, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}, 400, "Invalid type",
            "response_format.json_schema.schema"),
        req("schema-huge-bounds", {**BASE, "guided_json": {"type": "integer",
                                                          "minimum": -10 ** 30}},
            400, "", "guided_json"),
        req("schema-deep", {**BASE, "guided_json": _nested_schema(60)}, 200),
        req("regex-unclosed", {**BASE, "structured_outputs": {"regex": "[a-"}}, 400,
            "regex", "structured_outputs"),
        req("choices-too-many", {**BASE, "guided_choice": [str(i) for i in range(5000)]},
            400, "at most", "guided_choice"),
        req("two-constraints", {**BASE, "guided_regex": "a", "response_format": {
            "type": "json_object"}}, 400, "one way", "guided_regex"),
        req("tool-params-not-object", {**CHAT_BASE, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "array"}}}]}, 400, "",
            "tools.0.function.parameters", CHAT),
        req("tool-choice-unknown", {**CHAT_BASE, "tools": [{"type": "function", "function": {
            "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            400, "not among", "tool_choice", CHAT),
        req("logit-bias-huge-id", {**BASE, "logit_bias": {"9" * 30: 1}}, 400, "",
            "logit_bias"),
        # HTTP itself
        req("wrong-method", None, 405, "", None, COMPLETIONS, "GET"),
        req("header-too-large", BASE, 400, "malformed HTTP request",
            headers={"X-Padding": "x" * 10000}),
    ]
    if api_key:
        out.append(HostileRequest("authorization-not-utf8", build_request(
            "GET", "/v1/models", None, {"Authorization": b"Bearer \xff\xfe\xfd"}), 401,
            "API key"))
    return out
