"""Bad input, an injected engine-step failure and 64 concurrent streams: each answered as it
should be, and the server keeps serving with nothing left running."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from server_fixtures import (
    assert_error_body,
    metrics,
    offline_text,
    request,
    running_server,
    sse_events,
    wait_idle,
)
from faulty_server import StepFaults
from tessellm import SamplingParams

FAIL_MARK = "KABOOM"
GOOD = {"prompt": "Once upon a time", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_dir, chat_template_file):
    with running_server(tmp_path_factory.mktemp("server-robust"),
                        ["--model", str(stories_dir), "--dtype", "float32",
                         "--kernel-selection", "first", "--threads", "1", "--chat-template",
                         str(chat_template_file)],
                        faults=StepFaults(fail_on_prompt=FAIL_MARK)) as s:
        yield s


COMPLETIONS = "/v1/completions"
CHATS = "/v1/chat/completions"
BAD_INPUTS = [
    # (id, method, path, body or raw bytes, status, param)
    ("invalid-json", "POST", COMPLETIONS, b'{"prompt": "x",', 400, None),
    ("nan-json", "POST", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("not-an-object", "POST", COMPLETIONS, b'["x"]', 400, None),
    ("string-max-tokens", "POST", COMPLETIONS, {**GOOD, "max_tokens": "5"}, 400, "max_tokens"),
    ("bool-n", "POST", COMPLETIONS, {**GOOD, "n": True}, 400, "n"),
    ("string-temperature", "POST", COMPLETIONS, {**GOOD, "temperature": "hot"}, 400,
     "temperature"),
    ("prompt-number", "POST", COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    ("missing-prompt", "POST", COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    ("unknown-field", "POST", COMPLETIONS, {**GOOD, "frobnicate": 1}, 400, "frobnicate"),
    ("messages-not-list", "POST", CHATS, {"messages": "hi"}, 400, "messages"),
    ("bad-role", "POST", CHATS, {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role"),
    ("unknown-model", "POST", COMPLETIONS, {**GOOD, "model": "gpt-5"}, 404, "model"),
    ("unknown-model-chat", "POST", CHATS, {**CHAT, "model": "nope"}, 404, "model"),
    ("empty-prompt", "POST", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("empty-token-prompt", "POST", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("token-out-of-vocab", "POST", COMPLETIONS, {"prompt": [1, 99999]}, 400, None),
    ("prompt-too-long", "POST", COMPLETIONS, {"prompt": [1] + [261] * 600}, 400, "prompt"),
    ("max-tokens-zero", "POST", COMPLETIONS, {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", "POST", COMPLETIONS, {**GOOD, "max_tokens": -3}, 400, "max_tokens"),
    ("max-tokens-huge", "POST", COMPLETIONS, {**GOOD, "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ("max-tokens-over-context", "POST", COMPLETIONS, {**GOOD, "max_tokens": 510}, 400,
     "max_tokens"),
    ("chat-max-tokens-huge", "POST", CHATS, {**CHAT, "max_tokens": 100000}, 400, "max_tokens"),
    ("n-over-limit", "POST", COMPLETIONS, {**GOOD, "n": 17}, 400, "n"),
    ("n-zero", "POST", COMPLETIONS, {**GOOD, "n": 0}, 400, "n"),
    ("top-p-zero", "POST", COMPLETIONS, {**GOOD, "top_p": 0}, 400, "top_p"),
    ("logprobs-over-cap", "POST", COMPLETIONS, {**GOOD, "logprobs": 21}, 400, "logprobs"),
    ("top-logprobs-alone", "POST", CHATS, {**CHAT, "top_logprobs": 2}, 400, None),
    ("empty-stop", "POST", COMPLETIONS, {**GOOD, "stop": [""]}, 400, "stop"),
    ("logit-bias-key", "POST", COMPLETIONS, {**GOOD, "logit_bias": {"x": 1}}, 400,
     "logit_bias"),
    ("logit-bias-range", "POST", COMPLETIONS, {**GOOD, "logit_bias": {"5": 101}}, 400,
     "logit_bias.5"),
    ("logit-bias-out-of-vocab", "POST", COMPLETIONS, {**GOOD, "logit_bias": {"99999": 1}},
     400, "logit_bias"),
    ("priority", "POST", COMPLETIONS, {**GOOD, "priority": 3}, 400, "priority"),
    ("body-over-limit", "POST", COMPLETIONS, {"prompt": "x" * (1 << 20)}, 413, None),
    ("no-route", "GET", "/v1/nothing", None, 404, None),
    ("wrong-method", "GET", COMPLETIONS, None, 405, None),
]


@pytest.mark.parametrize("method,path,body,status,param",
                         [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_its_4xx_with_an_openai_error(server, method, path, body, status, param):
    raw = body if isinstance(body, bytes) else None
    got, headers, answer = request(server, method, path, None if raw else body, raw=raw)
    assert got == status, answer
    err = assert_error_body(answer)
    assert headers["x-request-id"]
    if param is not None:
        assert err["param"] == param, err
    if status == 404 and param == "model":
        assert err["code"] == "model_not_found"


def test_the_server_still_answers_correctly_after_bad_input(server, offline):
    status, _, body = request(server, "POST", COMPLETIONS, {**GOOD, "temperature": 0})
    assert status == 200
    assert body["choices"][0]["text"] == offline_text(
        offline, GOOD["prompt"], SamplingParams(max_tokens=4, temperature=0))


def test_a_failed_engine_step_fails_only_its_request(server, offline):
    bad = {"prompt": f"The {FAIL_MARK} story", "max_tokens": 8}
    status, _, body = request(server, "POST", COMPLETIONS, bad)
    assert status == 500 and assert_error_body(body)["type"] == "server_error"

    status, headers, text = request(server, "POST", COMPLETIONS, {**bad, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    assert assert_error_body(json.loads(events[-2]))["code"] == 500

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(
                model="stories260K-hf", stream=True, max_tokens=4,
                messages=[{"role": "user", "content": f"say {FAIL_MARK}"}]):
            pass
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="stories260K-hf", **bad)

    expected = offline_text(offline, "Once upon a time",
                            SamplingParams(max_tokens=16, temperature=0))
    out = client.completions.create(model="stories260K-hf", prompt="Once upon a time",
                                    max_tokens=16, temperature=0)
    assert out.choices[0].text == expected
    m = wait_idle(server)
    assert m["tessellm:kv_cache_usage_perc"] == 0
    assert m['tessellm:request_finished_total{finished_reason="error"}'] >= 4
    assert request(server, "GET", "/health")[0] == 200


async def _stream_text(session: aiohttp.ClientSession, url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
    text = ""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
    return text


def test_64_concurrent_streams_match_offline_greedy(server, offline):
    prompts = ["Once upon a time", "Lily and Tom", "The dog", "One day, a little girl",
               "Tim was happy", "The sun", "A big red ball", "She saw a bird"]
    expected = {p: offline_text(offline, p, SamplingParams(max_tokens=24, temperature=0))
                for p in prompts}
    jobs = [prompts[i % len(prompts)] for i in range(64)]

    async def run() -> list[str]:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            return await asyncio.gather(*(_stream_text(session, server.url + COMPLETIONS, p)
                                          for p in jobs))

    texts = asyncio.run(run())
    assert texts == [expected[p] for p in jobs]
    m = wait_idle(server)
    assert m["tessellm:num_requests_running"] == 0
    assert m["tessellm:num_requests_waiting"] == 0
    assert m["tessellm:kv_cache_usage_perc"] == 0
    assert metrics(server)["tessellm:time_to_first_token_seconds_count"] >= 64
