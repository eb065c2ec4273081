"""The guide's examples run as the pages show them: the offline API script on stories260K,
and the `openai` client script against a real `tessellm serve` of stories260K."""
from __future__ import annotations

import json
import subprocess
import sys

from docs_paths import EXAMPLES, REPO
from tessellm import LLM, SamplingParams


def test_the_offline_example_runs_and_its_greedy_line_is_the_engines(stories_dir) -> None:
    run = subprocess.run([sys.executable, str(EXAMPLES / "offline" / "generate.py"),
                          str(stories_dir)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    with LLM(str(stories_dir), dtype="float32", load_progress=False,
             kernel_selection="first") as llm:
        greedy = llm.generate(["Once upon a time"], SamplingParams(max_tokens=24,
                                                                   temperature=0))[0]
    assert lines[0] == f"{greedy.text} {greedy.finish_reason}"
    assert lines[1].startswith("0 ") and lines[2].startswith("1 ")
    ids = json.loads(lines[3])
    assert len(ids) == 2 and len(ids[1]) == 8             # ignore_eos: all 8 tokens
    assert lines[4].startswith("'user: Tell me a story.\\nassistant:'")


def test_the_openai_client_example_runs_against_a_real_server(on_sys_path, stories_dir,
                                                             tmp_path) -> None:
    on_sys_path(REPO / "tests" / "server")
    from server_fixtures import CHAT_TEMPLATE, running_server
    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = ["--model", str(stories_dir), "--dtype", "float32", "--kernel-selection", "first",
            "--chat-template", str(template)]
    with running_server(tmp_path, args) as server:
        run = subprocess.run([sys.executable, str(EXAMPLES / "server" / "openai_client.py"),
                              server.url], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr + server.log()[-3000:]
    out = run.stdout
    assert "model: stories260K-hf" in out and "streamed usage:" in out
    assert out.count("completion ") == 2 and "health: 200" in out
    assert "tessellm:generation_tokens_total" in out
