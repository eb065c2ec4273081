"""The engine core in its own process, seen from outside: metrics it reports (prefix-cache
hits, liveness, IPC time), and its death: open streams end with an error at once, /health
answers 503, the server exits non-zero, nothing hangs."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import time

import pytest
from server_fixtures import metrics, request, running_server, sse_events

# 80 token ids (5 full blocks of 16): two prompts that share them share 4 cached blocks
SHARED_PREFIX = [(7 * i) % 400 + 20 for i in range(80)]


def _args(stories_dir) -> list[str]:
    return ["--model", str(stories_dir), "--dtype", "float32", "--kernel-selection", "first",
            "--threads", "1", "--max-num-seqs", "8"]


@pytest.fixture
def server(tmp_path, stories_dir):
    with running_server(tmp_path, _args(stories_dir)) as s:
        yield s


def core_pid(server) -> int:
    m = re.search(r"engine core pid (\d+)", server.log())
    assert m, server.log()
    return int(m.group(1))


def test_the_core_is_its_own_process_and_reports_metrics(server):
    pid = core_pid(server)
    assert pid != server.proc.pid and os.path.exists(f"/proc/{pid}")
    m = metrics(server)
    assert m["tessellm:engine_core_alive"] == 1.0
    for prompt in (SHARED_PREFIX + [5, 6, 7], SHARED_PREFIX + [9, 10]):
        status, _, body = request(server, "POST", "/v1/completions",
                                  {"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert status == 200, body
    m = metrics(server)
    assert m["tessellm:prefix_cache_queries_total"] >= 2 * 80
    assert m["tessellm:prefix_cache_hits_total"] >= 4 * 16  # the second request's shared blocks
    assert m["tessellm:ipc_seconds_total"] > 0
    # one host/device synchronization per step (every step here samples)
    assert m["tessellm:host_device_syncs_total"] == m["tessellm:engine_steps_total"] > 0
    assert m['tessellm:engine_stage_seconds_total{stage="execute"}'] > 0


def test_killing_the_core_fails_open_streams_and_exits_nonzero(server):
    host, port = server.host_port
    conns, responses = [], []
    for _ in range(2):  # two long streams, both mid-generation when the core dies
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "Once upon a time", "max_tokens": 400, "stream": True,
             "ignore_eos": True}), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        conns.append(conn)
        responses.append(resp)
    t0 = time.monotonic()
    os.kill(core_pid(server), signal.SIGKILL)
    for resp in responses:
        events = sse_events(resp.read().decode())
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert "engine" in err["message"] and err["code"] == 500
    assert time.monotonic() - t0 < 5
    status, _, body = request(server, "GET", "/health")
    assert status == 503 and body["error"]["code"] in ("engine_unavailable", "shutting_down")
    assert server.proc.wait(20) == 1
    assert "engine core died" in server.log()
    for conn in conns:
        conn.close()
