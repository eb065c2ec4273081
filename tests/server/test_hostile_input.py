"""Hostile and unlucky input against a server with a small queue, short HTTP timeouts and a
connection cap: every request of the hostile catalogue gets its answer (never a 5xx, always
an error object), none leaves a trace (a queue of 8 survives many times 8 of them), slow
clients are cut off, and the server serves normally afterwards."""
from __future__ import annotations

import json
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import assert_error_body, metrics, request, running_server, wait_idle
from tessellm.testing.hostile_requests import hostile_requests
from tessellm.testing.raw_http import build_request, send_raw_blocking

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUE, MAX_CONNECTIONS = 8, 12
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, KEEPALIVE_TIMEOUT_S = 1.0, 1.0, 2.0
CATALOGUE = hostile_requests(MAX_QUEUE, KEY)


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_dir, chat_template_file):
    with running_server(tmp_path_factory.mktemp("server-hostile"),
                        ["--model", str(stories_dir), "--dtype", "float32",
                         "--kernel-selection", "first", "--threads", "1",
                         "--chat-template", str(chat_template_file),
                         "--max-queue", str(MAX_QUEUE), "--max-connections", str(MAX_CONNECTIONS),
                         "--header-timeout", str(HEADER_TIMEOUT_S),
                         "--body-timeout", str(BODY_TIMEOUT_S),
                         "--keepalive-timeout", str(KEEPALIVE_TIMEOUT_S)],
                        env={"TESSELLM_API_KEY": KEY}) as s:
        yield s


def assert_serves_normally(server) -> None:
    m = wait_idle(server, timeout=5)
    assert m["tessellm:num_requests_running"] == m["tessellm:num_requests_waiting"] == 0
    assert m["tessellm:kv_cache_usage_perc"] == 0
    status, _, body = request(server, "POST", "/v1/completions",
                              {"prompt": "Once upon a time", "max_tokens": 4}, headers=AUTH)
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    assert request(server, "GET", "/health")[0] == 200


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.name for c in CATALOGUE])
def test_each_hostile_request_gets_its_answer(server, case):
    response = send_raw_blocking(*server.host_port, case.raw)
    assert response.status == case.status, response.body[:500]
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    if case.status >= 400:
        err = assert_error_body(body)
        assert case.fragment in err["message"], err
        if case.param is not None:
            assert err["param"] == case.param, err
    if case.status == 405:
        assert response.headers["allow"] == "POST"


def test_no_hostile_request_leaves_a_trace_in_a_queue_of_eight(server):
    """Once, 8 such requests filled a queue of 8 for good (the server answered 503 to all
    after). Three rounds of the whole catalogue, then the queue is empty and serves."""
    for _ in range(3):
        for case in CATALOGUE:
            assert send_raw_blocking(*server.host_port, case.raw).status == case.status
    assert_serves_normally(server)


def test_a_tiny_temperature_is_greedy(server):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
    greedy = request(server, "POST", "/v1/completions", {**body, "temperature": 0},
                     headers=AUTH)[2]["choices"][0]["text"]
    for t in (1e-38, 1e-6):
        tiny = request(server, "POST", "/v1/completions", {**body, "temperature": t},
                       headers=AUTH)[2]["choices"][0]["text"]
        assert tiny == greedy


def test_a_half_sent_header_is_cut_off(server):
    t0 = time.monotonic()
    with socket.create_connection(server.host_port, timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        assert sock.recv(1024) == b""   # closed by the server
    assert HEADER_TIMEOUT_S - 0.2 <= time.monotonic() - t0 <= HEADER_TIMEOUT_S + 2.0


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_stalled_body_is_a_408(server, framing):
    head = build_request("POST", "/v1/completions", None, AUTH).removesuffix(b"\r\n\r\n")
    if framing == "chunked":
        head += b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        first = b"5\r\n{\"pro\r\n"
    else:
        head += b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        first = b'{"prompt'
    t0 = time.monotonic()
    with socket.create_connection(server.host_port, timeout=10) as sock:
        sock.sendall(head + first)   # and then nothing
        data = sock.recv(65536)
        assert BODY_TIMEOUT_S - 0.2 <= time.monotonic() - t0 <= BODY_TIMEOUT_S + 2.0
        while chunk := sock.recv(65536):   # closed after a short lingering
            data += chunk
    assert time.monotonic() - t0 <= BODY_TIMEOUT_S + 5.0
    status_line, _, rest = data.partition(b"\r\n")
    assert b" 408 " in status_line
    err = assert_error_body(json.loads(rest.partition(b"\r\n\r\n")[2]))
    assert err["code"] == "body_timeout"


def test_idle_connections_are_closed(server):
    t0 = time.monotonic()
    with socket.create_connection(server.host_port, timeout=10) as sock:   # never sends
        assert sock.recv(1024) == b""
    assert KEEPALIVE_TIMEOUT_S - 0.2 <= time.monotonic() - t0 <= KEEPALIVE_TIMEOUT_S + 2.0
    with socket.create_connection(server.host_port, timeout=10) as sock:   # after a request
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, t0 = b"", time.monotonic()
        while chunk := sock.recv(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 200")
    assert KEEPALIVE_TIMEOUT_S - 0.2 <= time.monotonic() - t0 <= KEEPALIVE_TIMEOUT_S + 2.0


def test_connections_past_the_cap_get_a_503(server):
    held = [socket.create_connection(server.host_port, timeout=10)
            for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)   # every one accepted
        with socket.create_connection(server.host_port, timeout=10) as extra:
            data = b""
            while chunk := extra.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 503")
        err = assert_error_body(json.loads(data.partition(b"\r\n\r\n")[2]))
        assert err["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert_serves_normally(server)
    assert metrics(server)["tessellm:engine_core_alive"] == 1.0


# ---- a fuzz test over the request schemas ------------------------------------------------

JSON_LEAVES = (st.none() | st.booleans() | st.integers(-(2 ** 100), 2 ** 100)
               | st.floats(allow_nan=False) | st.text(max_size=12)
               | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF,
                                       categories=["Cs"]), min_size=1, max_size=3))
ANY_JSON = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                        max_leaves=8)
SHORT_TEXT = st.text(min_size=1, max_size=6)
IN_RANGE = {   # values inside each field's range (the fuzz mixes them with anything at all)
    "max_tokens": st.integers(1, 6), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "seed": st.integers(-(2 ** 63), 2 ** 63 - 1),
    "stop": SHORT_TEXT | st.lists(SHORT_TEXT, max_size=20),
    "stop_token_ids": st.lists(st.integers(0, 600), max_size=4), "n": st.integers(1, 3),
    "stream": st.booleans(), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(), "priority": st.integers(0, 2),
    "logit_bias": st.dictionaries(st.integers(0, 600).map(str), st.floats(-100, 100),
                                  max_size=2),
    "user": SHORT_TEXT, "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans()}),
    "response_format": st.sampled_from([
        {"type": "text"}, {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"],
            "additionalProperties": False}}},
        {"type": "json_schema"}, {"type": "yaml"}]),
    "structured_outputs": st.sampled_from([
        {"regex": "[ab]{1,3}"}, {"choice": ["x", "y"]}, {"grammar": 'root ::= "ok"'},
        {"regex": "("}, {"choice": []}, {"json": "not json"}, {}, {"regex": "a", "choice": ["b"]}]),
    "guided_regex": st.sampled_from(["[0-9]{2}", "[", "a" * 300]),
    "guided_choice": st.lists(SHORT_TEXT, max_size=4),
}
COMPLETION_ONLY = {"prompt": st.text(max_size=30) | st.lists(st.integers(0, 600), max_size=8)
                   | st.lists(SHORT_TEXT, min_size=1, max_size=3),
                   "logprobs": st.integers(0, 5), "echo": st.booleans()}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": st.text(max_size=30)})
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"], "additionalProperties": False}}}
CHAT_ONLY = {"messages": st.lists(MESSAGE, min_size=1, max_size=3),
             "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
             "max_completion_tokens": st.integers(1, 6),
             "tools": st.sampled_from([[TOOL], [], [{"type": "function"}],
                                       [{"type": "function", "function": {"name": "g h"}}]]),
             "tool_choice": st.sampled_from(["auto", "none", "required",
                                             {"type": "function", "function": {"name": "f"}},
                                             {"type": "function", "function": {"name": "zz"}},
                                             "sometimes"]),
             "parallel_tool_calls": st.booleans()}


@st.composite
def request_bodies(draw) -> tuple[str, dict]:
    chat = draw(st.booleans())
    fields = {**IN_RANGE, **(CHAT_ONLY if chat else COMPLETION_ONLY)}
    body = ({"messages": [{"role": "user", "content": "hi"}]} if chat
            else {"prompt": "Once upon a time"})
    body["max_tokens"] = 4
    for name in draw(st.lists(st.sampled_from(sorted(fields) + ["frobnicate"]), max_size=5,
                              unique=True)):
        strategy = fields.get(name, ANY_JSON)
        body[name] = draw(strategy | ANY_JSON if draw(st.booleans()) else strategy)
    if draw(st.integers(0, 9)) == 0:
        body.pop(draw(st.sampled_from(sorted(body))))
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request_bodies())
def test_fuzzed_requests_never_get_a_5xx(server, path_and_body):
    path, body = path_and_body
    raw = json.dumps(body).encode()   # lone surrogates go out as \\udxxx escapes
    response = send_raw_blocking(*server.host_port, build_request("POST", path, raw, AUTH))
    assert response.status < 500, (body, response.body[:300])
    if response.status >= 400:
        assert_error_body(response.json())
        return
    assert response.status == 200
    if body.get("stream") is True:
        text = response.body.decode()
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-300:]


def test_after_the_fuzz_nothing_is_left_and_the_server_serves(server):
    assert_serves_normally(server)
