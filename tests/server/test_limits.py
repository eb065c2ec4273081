"""Limits and lifecycle on a deliberately small, slow server (one running sequence, one
waiting, 20 ms per engine step): API key, body limit, n limit, no chat template, queue full,
client disconnect, SIGTERM. The SIGTERM test stops the server: it must stay the last one."""
from __future__ import annotations

import asyncio
import http.client
import json
import time

import aiohttp
import openai
import pytest
from faulty_server import StepFaults
from server_fixtures import assert_error_body, metrics, request, running_server, wait_idle

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_dir):
    with running_server(tmp_path_factory.mktemp("server-limits"),
                        ["--model", str(stories_dir), "--dtype", "float32",
                         "--kernel-selection", "first", "--threads", "1", "--max-num-seqs", "1",
                         "--max-queue", "1", "--max-body-bytes", "4096", "--max-n", "2",
                         "--drain-timeout", "0.5"],
                        env={"TESSELLM_API_KEY": KEY},
                        faults=StepFaults(delay_s=0.02)) as s:
        yield s


def test_v1_needs_the_api_key_health_and_metrics_do_not(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, h, body = request(server, "GET", "/v1/models", headers=headers)
        assert status == 401 and h["www-authenticate"] == "Bearer"
        assert assert_error_body(body)["code"] == "invalid_api_key"
    status, _, body = request(server, "POST", "/v1/completions",
                              {"prompt": "x", "max_tokens": 1})
    assert status == 401
    assert request(server, "GET", "/v1/models", headers=AUTH)[0] == 200
    assert request(server, "GET", "/health")[0] == 200
    assert request(server, "GET", "/metrics")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong",
                      max_retries=0).models.list()
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model="stories260K-hf", prompt="Once", max_tokens=2).usage


def test_chat_without_a_template_is_a_clear_400(server):
    status, _, body = request(server, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hi"}]}, headers=AUTH)
    assert status == 400 and "--chat-template" in assert_error_body(body)["message"]


def test_body_and_n_limits(server):
    big = {"prompt": "x" * 5000, "max_tokens": 1}
    status, _, body = request(server, "POST", "/v1/completions", big, headers=AUTH)
    assert status == 413 and assert_error_body(body)
    host, port = server.host_port  # without Content-Length: the limit applies while reading
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("POST", "/v1/completions", body=iter([json.dumps(big).encode()]),
                 headers={**AUTH, "Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and assert_error_body(json.loads(resp.read()))
    conn.close()
    status, _, body = request(server, "POST", "/v1/completions",
                              {"prompt": "x", "max_tokens": 1, "n": 3}, headers=AUTH)
    assert status == 400 and assert_error_body(body)["param"] == "n"


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_form_content_types_are_refused(server, ctype):
    """A browser may POST these cross-origin without a preflight; the JSON API refuses them
    (415) before reading, so a page elsewhere cannot make a visitor's browser run requests."""
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    status, _, answer = request(server, "POST", "/v1/completions", raw=body,
                                headers={**AUTH, "Content-Type": ctype})
    assert status == 415 and "application/json" in assert_error_body(answer)["message"]
    status, _, _ = request(server, "POST", "/v1/completions", raw=body, headers=AUTH)
    assert status == 200


async def _first_event(resp: aiohttp.ClientResponse) -> str:
    async for line in resp.content:
        if line.startswith(b"data: "):
            return line.decode()
    raise AssertionError("stream ended without an event")


async def _waiting(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("tessellm:num_requests_waiting "):
                return float(line.split()[1])
    raise AssertionError("no waiting gauge")


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> aiohttp.ClientResponse:
    return await session.post(url, json=body)


def test_a_full_queue_answers_503_with_retry_after(server):
    url = server.url + "/v1/completions"

    async def run() -> None:
        async with aiohttp.ClientSession(headers=AUTH) as session:
            async with session.post(url, json=LONG) as running:  # holds the one running slot
                await _first_event(running)
                waiter = asyncio.create_task(_post(session, url, {"prompt": "Lily",
                                                                  "max_tokens": 3}))
                deadline = time.monotonic() + 5
                while await _waiting(session, server.url) < 1:
                    assert time.monotonic() < deadline, "the second request never waited"
                    await asyncio.sleep(0.01)
                async with session.post(url, json={"prompt": "Tom", "max_tokens": 3}) as full:
                    assert full.status == 503
                    assert int(full.headers["Retry-After"]) >= 1
                    assert_error_body(await full.json())
            # leaving `running` disconnects it: the waiting request runs and answers
            answered = await asyncio.wait_for(waiter, 10)
            assert answered.status == 200
            assert (await answered.json())["usage"]["completion_tokens"] == 3
            answered.release()

    asyncio.run(run())
    assert wait_idle(server, 2.0)["tessellm:kv_cache_usage_perc"] == 0


def test_a_client_that_disconnects_mid_stream_frees_its_blocks_within_a_second(server):
    aborted = 'tessellm:request_finished_total{finished_reason="abort"}'
    before = metrics(server).get(aborted, 0.0)

    async def stream_a_little() -> None:
        async with aiohttp.ClientSession(headers=AUTH) as session:
            async with session.post(server.url + "/v1/completions", json=LONG) as resp:
                for _ in range(3):
                    await _first_event(resp)
        # the session is closed: the connection is gone mid-stream

    asyncio.run(stream_a_little())
    t0 = time.monotonic()
    m = wait_idle(server, 1.0)
    assert time.monotonic() - t0 <= 1.0 + 0.2
    assert m["tessellm:kv_cache_usage_perc"] == 0 and m["tessellm:num_requests_running"] == 0
    assert metrics(server)[aborted] == before + 1  # aborted, not finished by itself


def test_a_client_that_leaves_a_non_streaming_request_frees_its_blocks_too(server):
    aborted = 'tessellm:request_finished_total{finished_reason="abort"}'
    before = metrics(server).get(aborted, 0.0)
    host, port = server.host_port
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({**LONG, "stream": False}),
                 headers={**AUTH, "Content-Type": "application/json"})
    deadline = time.monotonic() + 5
    while metrics(server)["tessellm:num_requests_running"] < 1:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.01)
    conn.close()  # gone before the answer
    m = wait_idle(server, 1.0)
    assert m["tessellm:kv_cache_usage_perc"] == 0 and m["tessellm:num_requests_running"] == 0
    assert metrics(server)[aborted] == before + 1


def test_sigterm_aborts_what_cannot_drain_and_exits_0(server):
    """Last test of the module: it stops the server."""
    host, port = server.host_port
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(LONG),
                 headers={**AUTH, "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: ")
    t0 = time.monotonic()
    assert server.stop(timeout=20) == 0
    assert time.monotonic() - t0 < 10
    rest = resp.read().decode()
    events = [line[len("data: "):] for line in rest.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = assert_error_body(json.loads(events[-2]))
    assert "shutting down" in err["message"] and err["code"] == 503
    conn.close()
    assert "shutting down" in server.log()

