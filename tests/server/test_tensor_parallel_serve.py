"""`tessellm serve --tensor-parallel-size 2`: the served path streams what one offline process
generates, and a killed rank ends open streams with an error, turns /health to 503 and makes
the server exit non-zero (nothing hangs)."""
from __future__ import annotations

import json
import re

import pytest
from server_fixtures import (assert_killed_worker_ends_the_server, offline_text,
                             open_stream, running_server, sse_events)

from tessellm import LLM, SamplingParams

pytestmark = pytest.mark.slow


def _args(stories_dir) -> list[str]:
    return ["--model", str(stories_dir), "--dtype", "float32", "--kernel-selection", "first",
            "--threads", "1", "--max-num-seqs", "8", "--tensor-parallel-size", "2"]


@pytest.fixture
def server(tmp_path, stories_dir):
    with running_server(tmp_path, _args(stories_dir)) as s:
        yield s


def test_served_with_two_ranks_streams_the_offline_text(server, stories_dir):
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    with LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False,
             kernel_selection="first") as llm:
        want = [offline_text(llm, p, params) for p in ("Once upon a time", "The little dog")]
    got = []
    for prompt in ("Once upon a time", "The little dog"):
        conn, resp = open_stream(server, {"prompt": prompt, "max_tokens": 48,
                                          "temperature": 0, "ignore_eos": True})
        assert resp.status == 200
        events = sse_events(resp.read().decode())
        assert events[-1] == "[DONE]"
        got.append("".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]))
        conn.close()
    assert got == want


def test_killing_a_rank_ends_open_streams_and_the_server(server):
    m = re.search(r"tensor-parallel rank 1: pid (\d+)", server.log())
    assert m, server.log()
    assert_killed_worker_ends_the_server(server, int(m.group(1)), "rank", streams=2)
