"""The `tessellm` command, run in-process through its main()."""
from __future__ import annotations

import json


from tessellm.cli.main import main


def test_generate_on_the_demo_model_says_it_is_untrained(capsys):
    assert main(["generate", "--model", "demo", "--prompt", "Hello", "--max-tokens", "5",
                 "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "untrained" in err
    from tessellm import LLM, SamplingParams
    offline = LLM("demo", device="cpu", load_progress=False).generate(
        ["Hello"], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert len(offline.token_ids) == 5
    assert out == offline.text + "\n"  # the CLI prints the greedy text (byte-level gibberish)


def test_generate_on_stories_prints_the_reference_continuation(capsys, stories_dir):
    ref = json.loads((stories_dir / "reference_greedy.json").read_text())
    assert main(["generate", "--model", str(stories_dir), "--prompt", ref["prompt"],
                 "--max-tokens", "40", "--temperature", "0", "--dtype", "float32"]) == 0
    out, _ = capsys.readouterr()
    assert ref["prompt"] + out.rstrip("\n") == ref["text"]


def test_generate_chat_uses_the_chat_template(capsys):
    """--chat on the default model (SmolLM2-135M-Instruct): the reply LLM.chat gives, with and
    without a --system message."""
    from tessellm import LLM, SamplingParams
    question = {"role": "user", "content": "What is the capital of France?"}
    llm = LLM(device="cpu", kernel_selection="first", load_progress=False)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    for system in (None, "Answer briefly."):
        extra = ["--system", system] if system else []
        assert main(["generate", "--chat", "--prompt", question["content"], "--max-tokens",
                     "12", "--device", "cpu", "--kernel-selection", "first", *extra]) == 0
        out, _ = capsys.readouterr()
        messages = ([{"role": "system", "content": system}] if system else []) + [question]
        want = llm.chat(messages, params)[0].text
        assert out == want + "\n"
        if system is None:
            assert "Paris" in want


def test_plugins_json_lists_cpu_and_sim(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    devices = {d["name"]: d for r in rows for d in r["devices"]}
    assert devices["cpu"]["available"] and "sim" in devices
    assert all({"plugin", "version", "status", "error"} <= set(r) for r in rows)


def test_kernels_prints_a_ranking_per_op(capsys, stories_dir):
    assert main(["kernels", "--model", str(stories_dir), "--dtype", "float32",
                 "--buckets", "1,32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    decode = [r for r in rows if r["query"].startswith("attention_decode|float32|T32")]
    assert decode and len(decode[0]["ranking"]) >= 2
    assert decode[0]["choice"] == decode[0]["ranking"][0]["kernel"]


def test_bench_throughput_prints_one_json_line(capsys, stories_dir):
    assert main(["bench", "throughput", "--model", str(stories_dir), "--num-prompts", "4",
                 "--input-len", "40", "--output-len", "4", "--dtype", "float32",
                 "--runs", "2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()
    assert len(line) == 1
    result = json.loads(line[0])
    assert result["gen_tokens"] == 16 and len(result["gen_tok_per_s_runs"]) == 2
    assert {"gen_tok_per_s", "total_tok_per_s", "wall_s"} <= set(result)
    # the warm-up and every timed run have prompts of their own: no prefix-cache hits
    assert result["prefix_hit_tokens"] == 0


def test_bench_latency_profile_says_where_the_time_goes(capsys, stories_dir):
    assert main(["bench", "latency", "--model", str(stories_dir), "--input-len", "20",
                 "--output-len", "4", "--dtype", "float32", "--runs", "1", "--profile"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    prof = result["profile"]
    assert prof["steps"] == 4
    assert {"linear", "attention_decode", "rotary_embedding"} <= set(prof["ops"])
    assert set(prof["stages_ms_per_step"]) >= {"schedule", "execute", "sample"}


def test_errors_are_reported_without_a_traceback(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "tessellm: error:" in capsys.readouterr().err


def test_unknown_device_is_a_clear_error(capsys):
    assert main(["generate", "--prompt", "x", "--device", "tpu9000"]) == 2
    err = capsys.readouterr().err
    assert "tpu9000" in err and "cpu" in err


def test_an_unwritable_cache_dir_for_the_demo_model_is_a_clear_error(capsys, tmp_path,
                                                                      monkeypatch):
    """`--model demo` writes the demo model into the cache dir; one that cannot be written
    (here a path under a regular file, which even root cannot create) is exit 2 and one
    line, for `serve` as for `generate`."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TESSELLM_CACHE_DIR", str(blocker / "cache"))
    for command in (["generate", "--prompt", "x"], ["serve", "--port", "0"]):
        assert main([*command, "--model", "demo"]) == 2
        err = capsys.readouterr().err
        assert "tessellm: error: cannot write the demo model" in err
        assert "TESSELLM_CACHE_DIR" in err and "Traceback" not in err


def test_generate_constrained_by_a_json_schema_or_a_regex(capsys, stories_dir, tmp_path):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    base = ["generate", "--model", str(stories_dir), "--prompt", "Once", "--dtype", "float32",
            "--kernel-selection", "first"]
    assert main([*base, "--json-schema", str(path), "--max-tokens", "300"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"name"}
    assert main([*base, "--regex", "[a-z]{2,6} (cat|dog)", "--max-tokens", "20"]) == 0
    import re
    assert re.fullmatch("[a-z]{2,6} (cat|dog)", capsys.readouterr().out.rstrip("\n"))
    assert main([*base, "--regex", "a", "--json-schema", str(path)]) == 2
    assert main([*base, "--regex", "[a-"]) == 2
    assert "invalid regex" in capsys.readouterr().err
