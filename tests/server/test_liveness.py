"""A frozen engine core is seen and handled (its process stopped with SIGSTOP, as a deadlock
or a swapped-out machine would look): /health answers 503 within the heartbeat timeout and new
requests get 503, requests in flight fail after the stall timeout, and everything recovers
when the core comes back. And a per-request timeout ends a request with an error."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import time

import pytest
from faulty_server import StepFaults
from server_fixtures import assert_error_body, metrics, request, running_server, sse_events, \
    wait_idle

HEARTBEAT_TIMEOUT_S, STALL_TIMEOUT_S, REQUEST_TIMEOUT_S = 1.0, 4.0, 7.0
STEP_DELAY_S = 0.02   # every engine step (injected): max_tokens=400 takes ~8 s


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_dir):
    with running_server(tmp_path_factory.mktemp("server-liveness"),
                        ["--model", str(stories_dir), "--dtype", "float32",
                         "--kernel-selection", "first", "--threads", "1",
                         "--engine-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
                         "--engine-stall-timeout", str(STALL_TIMEOUT_S),
                         "--request-timeout", str(REQUEST_TIMEOUT_S)],
                        faults=StepFaults(delay_s=STEP_DELAY_S)) as s:
        yield s


def core_pid(server) -> int:
    m = re.search(r"engine core pid (\d+)", server.log())
    assert m, server.log()
    return int(m.group(1))


def open_stream(server, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = server.host_port
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
         "temperature": 0, "stream": True}), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")   # generation has started
    return conn, response


def wait_for_health(server, status: int, within_s: float) -> float:
    """Seconds until /health answers `status` (fails past `within_s`)."""
    t0 = time.monotonic()
    while True:
        got, _, body = request(server, "GET", "/health")
        if got == status:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, (got, body)
        time.sleep(0.05)


def test_a_briefly_stopped_core_is_unhealthy_then_recovers_and_finishes(server):
    pid = core_pid(server)
    conn, stream = open_stream(server, max_tokens=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        seen_after = wait_for_health(server, 503, within_s=HEARTBEAT_TIMEOUT_S + 1.5)
        assert seen_after <= HEARTBEAT_TIMEOUT_S + 1.0
        status, _, body = request(server, "GET", "/health")
        assert status == 503 and assert_error_body(body)["code"] == "engine_unresponsive"
        assert "has not reported" in body["error"]["message"]
        status, headers, body = request(server, "POST", "/v1/completions",
                                        {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and headers["retry-after"] == "1"
        assert assert_error_body(body)["code"] == "engine_unresponsive"
        assert metrics(server)["tessellm:engine_core_responsive"] == 0.0
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for_health(server, 200, within_s=2.0)
    events = sse_events(stream.read().decode())   # the stream goes on where it stopped
    conn.close()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] \
        == "length"
    assert metrics(server)["tessellm:engine_core_responsive"] == 1.0
    m = wait_idle(server, timeout=5)
    assert m["tessellm:num_requests_running"] == m["tessellm:num_requests_waiting"] == 0


def test_a_core_stopped_past_the_stall_timeout_fails_requests_in_flight(server):
    pid = core_pid(server)
    conn, stream = open_stream(server, max_tokens=100)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        events = sse_events(stream.read().decode())   # ends without the core's help
        waited = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
        conn.close()
    assert STALL_TIMEOUT_S - 0.5 <= waited <= STALL_TIMEOUT_S + 2.0, waited
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert "stalled" in assert_error_body(error)["message"]
    wait_for_health(server, 200, within_s=2.0)
    status, _, body = request(server, "POST", "/v1/completions",
                              {"prompt": "Once upon a time", "max_tokens": 3})
    assert status == 200, body
    m = wait_idle(server, timeout=5)   # the aborted request was freed in the core too
    assert m["tessellm:num_requests_running"] == m["tessellm:num_requests_waiting"] == 0
    assert m["tessellm:kv_cache_usage_perc"] == 0


def test_the_request_timeout_ends_a_request_with_an_error(server):
    conn, stream = open_stream(server, max_tokens=400)   # ~8 s of steps
    t0 = time.monotonic()
    status, _, body = request(server, "POST", "/v1/completions",
                              {"prompt": "Once upon a time", "max_tokens": 400,
                               "ignore_eos": True})
    assert status == 504 and assert_error_body(body)["code"] == "request_timeout"
    events = sse_events(stream.read().decode())
    conn.close()
    assert REQUEST_TIMEOUT_S - 1.0 <= time.monotonic() - t0 <= REQUEST_TIMEOUT_S + 2.0
    assert events[-1] == "[DONE]"
    assert assert_error_body(json.loads(events[-2]))["code"] == "request_timeout"
    m = wait_idle(server, timeout=5)
    assert m["tessellm:num_requests_running"] == 0 and m["tessellm:kv_cache_usage_perc"] == 0
