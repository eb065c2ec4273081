"""The official `openai` client, unmodified, against `tessellm serve` with stories260K."""
from __future__ import annotations

import json
import time

import pytest
from openai import OpenAI
from server_fixtures import (CHAT_TEMPLATE, offline_text, request, running_server, sse_events,
                             wait_idle)
from tessellm import SamplingParams

PROMPT = "Once upon a time"
MULTIBYTE_SEED = 21  # with PROMPT at temperature 1.5: the output has a 3-byte character (’)


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_dir, chat_template_file):
    workdir = tmp_path_factory.mktemp("server-openai")
    config = workdir / "serve.yaml"
    config.write_text(f"model: {stories_dir}\ndtype: float32\nkernel_selection: first\n"
                      f"max_num_seqs: 16\nmax_n: 4\nnum_threads: 1\n")
    with running_server(workdir, ["--config", str(config), "--chat-template",
                                  str(chat_template_file)]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def greedy(offline, prompt, max_tokens: int) -> str:
    return offline_text(offline, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))


def test_models_lists_the_directory_name(client):
    assert [m.id for m in client.models.list().data] == ["stories260K-hf"]


def test_completion_greedy_equals_offline(client, offline, stories_dir):
    out = client.completions.create(model="stories260K-hf", prompt=PROMPT, max_tokens=40,
                                    temperature=0)
    assert out.choices[0].text == greedy(offline, PROMPT, 40)
    assert out.choices[0].finish_reason == "length"
    prompt_len = len(offline.encode(PROMPT))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens,
            out.usage.total_tokens) == (prompt_len, 40, prompt_len + 40)
    # the full model path is accepted as the model name too
    again = client.completions.create(model=str(stories_dir), prompt=PROMPT, max_tokens=40,
                                      temperature=0)
    assert again.choices[0].text == out.choices[0].text


def test_priority_extension_field_is_accepted(client, offline):
    out = client.completions.create(model="stories260K-hf", prompt=PROMPT, max_tokens=12,
                                    temperature=0, extra_body={"priority": 2})
    assert out.choices[0].text == greedy(offline, PROMPT, 12)


def test_completion_stream_concatenates_to_the_whole_text_and_reports_usage(client, offline):
    chunks = list(client.completions.create(
        model="stories260K-hf", prompt=PROMPT, max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == greedy(offline, PROMPT, 32)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32


def test_chat_greedy_equals_offline_on_the_rendered_template(client, offline):
    messages = [{"role": "system", "content": "Tell a story."},
                {"role": "user", "content": "Once upon a time"}]
    out = client.chat.completions.create(model="stories260K-hf", messages=messages,
                                         max_tokens=24, temperature=0)
    rendered = offline.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE,
                                                     tokenize=False, add_generation_prompt=True)
    ids = offline.tokenizer.encode(rendered, add_special_tokens=False)
    expected = offline_text(offline, ids, SamplingParams(max_tokens=24, temperature=0))
    msg = out.choices[0].message
    assert (msg.role, msg.content) == ("assistant", expected)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 24
    stream = client.chat.completions.create(model="stories260K-hf", messages=messages,
                                            max_tokens=24, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_choices_are_indexed_and_a_seed_reproduces_them(client):
    kwargs = dict(model="stories260K-hf", prompt=PROMPT, max_tokens=24, temperature=1.0,
                  n=2, seed=7)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1]
    by_index = lambda r: [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert by_index(a) == by_index(b)
    assert by_index(a)[0] != by_index(a)[1]  # choice i samples with seed + i
    assert a.usage.completion_tokens == 48
    single = client.completions.create(model="stories260K-hf", prompt=PROMPT, max_tokens=24,
                                       temperature=1.0, seed=8)
    assert single.choices[0].text == by_index(a)[1]
    streamed = client.completions.create(**kwargs, stream=True)
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == by_index(a)


def test_stop_string_is_trimmed(client, offline):
    full = greedy(offline, PROMPT, 40)  # ", there was a little girl named Lily. She loved..."
    assert "Lily" in full
    out = client.completions.create(model="stories260K-hf", prompt=PROMPT, max_tokens=40,
                                    temperature=0, stop=["Lily", "zzz"])
    assert out.choices[0].text == full[:full.index("Lily")]
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="stories260K-hf", prompt=PROMPT,
                                            max_tokens=40, temperature=0, stop="Lily",
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index("Lily")]


def test_completion_logprobs(client):
    out = client.completions.create(model="stories260K-hf", prompt=PROMPT, max_tokens=8,
                                    temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        best = max(top, key=top.get)
        assert best == token and top[best] == pytest.approx(logprob)  # greedy = top-1


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model="stories260K-hf", messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert bytes(c.bytes).decode() == c.token


def test_streamed_multibyte_text_concatenates_exactly(client, offline):
    params = dict(model="stories260K-hf", prompt=PROMPT, max_tokens=48, temperature=1.5,
                  seed=MULTIBYTE_SEED)
    whole = client.completions.create(**params).choices[0].text
    assert any(ord(ch) > 127 for ch in whole), whole  # the case under test really happens
    assert any(len(ch.encode()) > 1 for ch in whole)
    pieces = [c.choices[0].text for c in client.completions.create(**params, stream=True)]
    assert "".join(pieces) == whole
    assert "\ufffd" not in "".join(pieces)
    assert whole == offline_text(offline, PROMPT, SamplingParams(
        max_tokens=48, temperature=1.5, seed=MULTIBYTE_SEED))


def test_request_id_is_echoed_and_validated(server):
    status, headers, body = request(server, "POST", "/v1/completions",
                                    {"prompt": PROMPT, "max_tokens": 2},
                                    headers={"X-Request-Id": "my-trace-42"})
    assert status == 200 and headers["x-request-id"] == "my-trace-42"
    assert body["id"].startswith("cmpl-")  # the server's own id, never the client's
    deadline = time.monotonic() + 5       # logged (the access log line follows the answer)
    while "my-trace-42" not in server.log():
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.05)
    status, headers, _ = request(server, "GET", "/v1/models")
    assert headers["x-request-id"].startswith("cmpl-")
    for bad in ("x" * 129, "tab\there"):
        status, headers, body = request(server, "GET", "/v1/models",
                                        headers={"X-Request-Id": bad})
        assert status == 400 and body["error"]["param"] == "X-Request-Id"


def test_concurrent_requests_may_share_a_client_request_id(server):
    """The client's X-Request-Id is echoed, never the engine's id: three concurrent streams
    with the same one all succeed (each with its own response id)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(_):
        return request(server, "POST", "/v1/completions",
                       {"prompt": PROMPT, "max_tokens": 12, "stream": True},
                       headers={"X-Request-Id": "same-id"})
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(one, range(3)))
    assert [a[0] for a in answers] == [200, 200, 200]
    assert all(h["x-request-id"] == "same-id" for _, h, _ in answers)
    ids = {json.loads(sse_events(body)[0])["id"] for _, _, body in answers}
    assert len(ids) == 3 and all("[DONE]" in body for _, _, body in answers)


def test_nothing_is_left_running(server):
    m = wait_idle(server)
    assert m["tessellm:num_requests_running"] == 0 and m["tessellm:kv_cache_usage_perc"] == 0
