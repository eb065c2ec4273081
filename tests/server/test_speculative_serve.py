"""A server started with --speculative-config answers with the tokens a plain engine gives,
streamed and whole, reports speculation in /metrics and the dashboard, and refuses a bad
config at start-up with a message that names the problem."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from server_fixtures import metrics, request, running_server, sse_events, wait_idle
from tessellm import LLM, SamplingParams

PROMPT = ("Tom had a red ball. Tom had a red ball. Tom liked the ball. Tom had a red ball. "
          "Tom had a")
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_dir):
    with running_server(tmp_path_factory.mktemp("server-speculative"),
                        ["--model", str(stories_dir), "--dtype", "float32",
                         "--kernel-selection", "first", "--threads", "1",
                         "--max-num-seqs", "4", "--speculative-config", json.dumps(SPEC)]) as s:
        yield s


def test_answers_equal_the_plain_engine_and_metrics_count_drafts(server, stories_dir):
    want = LLM(str(stories_dir), dtype="float32", load_progress=False,
               kernel_selection="first").generate(
        [PROMPT], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].text
    body = {"model": "stories260K-hf", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    status, _, out = request(server, "POST", "/v1/completions", body)
    assert status == 200, out
    assert out["choices"][0]["text"] == want
    assert out["usage"]["completion_tokens"] == 40
    status, _, text = request(server, "POST", "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(e) for e in sse_events(text) if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
    m = wait_idle(server)
    key = '{method="ngram"}'
    assert m[f"tessellm:spec_decode_num_accepted_tokens_total{key}"] > 0
    assert m[f"tessellm:spec_decode_num_drafts_total{key}"] > 0
    assert 0 < m[f"tessellm:spec_decode_acceptance_rate{key}"] <= 1
    assert 1 < m[f"tessellm:spec_decode_mean_accepted_length{key}"] <= 4
    status, _, dash = request(server, "GET", "/api/dashboard")
    assert status == 200 and dash["speculative"]["method"] == "ngram"
    assert dash["speculative"]["accepted_tokens"] > 0


def test_a_stop_string_ends_where_it_would_without_speculation(server, stories_dir):
    plain = LLM(str(stories_dir), dtype="float32", load_progress=False,
                kernel_selection="first")
    text = plain.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0.0,
                                                   ignore_eos=True))[0].text
    stop = text[10:14]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    want = plain.generate([PROMPT], params)[0]
    status, _, out = request(server, "POST", "/v1/completions", {
        "model": "stories260K-hf", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
        "ignore_eos": True, "stop": [stop]})
    assert status == 200, out
    assert out["choices"][0]["text"] == want.text
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len(want.token_ids)


@pytest.mark.parametrize("config, message", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "unknown speculative method 'eagle'"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
    ('{"method": "ngram"', "--speculative-config: not JSON"),
    ('[1, 2]', "expected a JSON object"),
])
def test_a_bad_config_is_refused_at_start_up(stories_dir, config, message):
    proc = subprocess.run([sys.executable, "-m", "tessellm.cli.main", "serve", "--model",
                           str(stories_dir), "--port", "0", "--speculative-config", config],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout


@pytest.mark.parametrize("value", [-1, 17, 4, "3", 2.5, True, [1], {"k": 2}, 10**30])
def test_hostile_num_speculative_tokens_is_a_400(server, value):
    status, _, body = request(server, "POST", "/v1/completions", {
        "model": "stories260K-hf", "prompt": PROMPT, "max_tokens": 5,
        "num_speculative_tokens": value})
    assert status == 400, body
    assert "num_speculative_tokens" in json.dumps(body)
    if value == 4:   # well-formed, over the server's k: refused at admission (above)
        return
    status, _, body = request(server, "POST", "/v1/chat/completions", {
        "model": "stories260K-hf", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5, "num_speculative_tokens": value})
    assert status == 400 and "num_speculative_tokens" in json.dumps(body), body


def test_a_request_may_lower_or_turn_off_speculation(server):
    for k in (0, 1, 3):
        status, _, out = request(server, "POST", "/v1/completions", {
            "model": "stories260K-hf", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "num_speculative_tokens": k})
        assert status == 200, out
    assert wait_idle(server)["tessellm:kv_cache_usage_perc"] == 0
