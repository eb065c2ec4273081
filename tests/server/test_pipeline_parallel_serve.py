"""`tessellm serve --pipeline-parallel-size 2`: the served path streams what one offline
process generates, and a killed stage ends every open stream with an error naming the stage,
turns /health to 503 and makes the server exit non-zero (nothing hangs)."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import time

import pytest
from server_fixtures import offline_text, request, running_server, sse_events

from tessellm import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path, stories_dir):
    with running_server(tmp_path, [
            "--model", str(stories_dir), "--dtype", "float32", "--kernel-selection", "first",
            "--threads", "1", "--max-num-seqs", "8", "--pipeline-parallel-size", "2"]) as s:
        yield s


def _stream(server, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = server.host_port
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_two_stages_serve_the_offline_text_and_a_killed_stage_ends_the_server(server,
                                                                               stories_dir):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    with LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False,
             kernel_selection="first") as llm:
        want = offline_text(llm, "Once upon a time", params)
    conn, resp = _stream(server, {"prompt": "Once upon a time", "max_tokens": 32,
                                  "temperature": 0, "ignore_eos": True})
    events = sse_events(resp.read().decode())
    conn.close()
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == want

    m = re.search(r"pipeline stage 1 \(rank 1\): pid (\d+)", server.log())
    assert m, server.log()
    streams = [_stream(server, {"prompt": "Once upon a time", "max_tokens": 400,
                                "ignore_eos": True}) for _ in range(3)]
    for _, resp in streams:
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
    t0 = time.monotonic()
    os.kill(int(m.group(1)), signal.SIGKILL)
    for conn, resp in streams:
        events = sse_events(resp.read().decode())
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert "pipeline stage 1 (rank 1)" in err["message"] and err["code"] == 500, err
        conn.close()
    assert time.monotonic() - t0 < 10
    status, _, body = request(server, "GET", "/health")
    assert status == 503 and body["error"]["code"] in ("engine_unavailable", "shutting_down")
    assert server.proc.wait(30) == 1
