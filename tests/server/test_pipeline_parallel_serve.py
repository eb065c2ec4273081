"""`tessellm serve --pipeline-parallel-size 2`: the served path streams what one offline
process generates, and a killed stage ends every open stream with an error naming the stage,
turns /health to 503 and makes the server exit non-zero (nothing hangs)."""
from __future__ import annotations

import json
import re

import pytest
from server_fixtures import (assert_killed_worker_ends_the_server, offline_text,
                             open_stream, running_server, sse_events)

from tessellm import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path, stories_dir):
    with running_server(tmp_path, [
            "--model", str(stories_dir), "--dtype", "float32", "--kernel-selection", "first",
            "--threads", "1", "--max-num-seqs", "8", "--pipeline-parallel-size", "2"]) as s:
        yield s


def test_two_stages_serve_the_offline_text_and_a_killed_stage_ends_the_server(server,
                                                                               stories_dir):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    with LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False,
             kernel_selection="first") as llm:
        want = offline_text(llm, "Once upon a time", params)
    conn, resp = open_stream(server, {"prompt": "Once upon a time", "max_tokens": 32,
                                      "temperature": 0, "ignore_eos": True})
    events = sse_events(resp.read().decode())
    conn.close()
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == want

    m = re.search(r"pipeline stage 1 \(rank 1\): pid (\d+)", server.log())
    assert m, server.log()
    assert_killed_worker_ends_the_server(server, int(m.group(1)), "pipeline stage 1 (rank 1)",
                                         streams=3)
