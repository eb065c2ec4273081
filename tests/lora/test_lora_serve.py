"""`tessellm serve --enable-lora --lora-modules ...`: a request's `model` picks an adapter and
gets the offline engine's tokens for it; /v1/models lists the adapters with their parent;
runtime load/unload (behind --allow-runtime-lora and the API key); per-adapter metrics; bad
names, paths, ranks and bodies are 4xx with OpenAI's error shape and disturb nothing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lora_fixtures import make_adapter, make_base
from server_fixtures import assert_error_body, request, running_server, wait_idle
from tessellm import LLM, LoRARequest, SamplingParams

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [128000, 9906, 1070, 11, 1268, 527, 499]   # token ids of the llama3 vocabulary
OPTIONS = ["--dtype", "float32", "--kernel-selection", "first", "--threads", "1",
           "--max-num-seqs", "4", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora-serve")
    base = make_base("llama", root / "base")
    for i, rank in enumerate((4, 8, 8, 16)):
        make_adapter(base, root / f"ad{i}", seed=200 + i, rank=rank)
    return root


@pytest.fixture(scope="module")
def server(models: Path, tmp_path_factory: pytest.TempPathFactory):
    args = ["--model", str(models / "base"), *OPTIONS, "--api-key", KEY,
            "--allow-runtime-lora", "--lora-modules", f"ad0={models / 'ad0'}",
            f'{{"name": "ad1", "path": "{models / "ad1"}"}}']
    with running_server(tmp_path_factory.mktemp("server-lora"), args) as s:
        yield s


@pytest.fixture(scope="module")
def offline(models: Path) -> LLM:
    return LLM(str(models / "base"), dtype="float32", kernel_selection="first",
               load_progress=False, enable_lora=True, max_loras=2, max_lora_rank=8)


def _complete(server, model: str, **extra) -> tuple[int, object]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, **extra}
    status, _, out = request(server, "POST", "/v1/completions", body, AUTH)
    return status, out


def _offline(offline: LLM, models: Path, name: str | None, int_id: int = 0) -> str:
    lora = None if name is None else LoRARequest(name, int_id, str(models / name))
    return offline.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0,
                                                     ignore_eos=True), lora_request=lora)[0].text


def test_model_field_selects_the_adapter(server, offline, models) -> None:
    texts = {}
    for name, int_id in (("base", 0), ("ad0", 1), ("ad1", 2)):
        status, out = _complete(server, name if int_id else str(models / "base"))
        assert status == 200, out
        assert out["model"] == (name if int_id else "base")
        texts[name] = out["choices"][0]["text"]
        assert texts[name] == _offline(offline, models, None if not int_id else name, int_id)
    assert len(set(texts.values())) == 3
    status, _, out = request(server, "POST", "/v1/chat/completions", {
        "model": "ad1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        AUTH)
    assert status == 200 and out["model"] == "ad1", out


def test_models_lists_adapters_with_their_parent(server) -> None:
    status, _, out = request(server, "GET", "/v1/models", headers=AUTH)
    assert status == 200
    cards = {c["id"]: c for c in out["data"]}
    assert set(cards) >= {"base", "ad0", "ad1"}
    assert cards["ad0"]["parent"] == "base" and "parent" not in cards["base"]


def test_unknown_adapter_is_a_404(server) -> None:
    status, out = _complete(server, "no-such-adapter")
    assert status == 404
    err = assert_error_body(out)
    assert err["code"] == "model_not_found" and "ad0" in err["message"]


def test_runtime_load_and_unload(server, offline, models) -> None:
    load = {"lora_name": "ad2", "lora_path": str(models / "ad2")}
    status, _, out = request(server, "POST", "/v1/load_lora_adapter", load)
    assert status == 401                                  # behind the API key
    status, _, out = request(server, "POST", "/v1/load_lora_adapter", load, AUTH)
    assert status == 200, out
    status, out = _complete(server, "ad2")
    assert status == 200 and out["choices"][0]["text"] == _offline(offline, models, "ad2", 3)
    status, _, out = request(server, "POST", "/v1/load_lora_adapter", load, AUTH)
    assert status == 409 and assert_error_body(out)["param"] == "lora_name"
    status, _, out = request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "ad2"},
                             AUTH)
    assert status == 200, out
    assert _complete(server, "ad2")[0] == 404
    status, _, out = request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "ad2"},
                             AUTH)
    assert status == 404
    # the name again, now for other weights: a new id, never the old ones' cache or slot
    status, _, out = request(server, "POST", "/v1/load_lora_adapter",
                             {"lora_name": "ad2", "lora_path": str(models / "ad1")}, AUTH)
    assert status == 200, out
    assert _complete(server, "ad2")[1]["choices"][0]["text"] == _complete(server, "ad1")[1][
        "choices"][0]["text"]
    request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "ad2"}, AUTH)


@pytest.mark.parametrize("body, status, param", [
    ({"lora_name": "x", "lora_path": "/no/such/dir"}, 400, "lora_path"),
    ({"lora_name": "base", "lora_path": "/tmp"}, 409, "lora_name"),
    ({"lora_name": 5, "lora_path": "/tmp"}, 400, None),
    ({"lora_name": "x"}, 400, None),
    ({"lora_name": "x", "lora_path": "/tmp", "extra": 1}, 400, None),
    ({"lora_name": "x" * 5000, "lora_path": "/tmp"}, 400, None),
    ({"lora_name": {"nested": ["x"]}, "lora_path": "/tmp"}, 400, None),
    ({"lora_name": "bad name!", "lora_path": "/tmp"}, 400, "lora_name"),
    ([1, 2], 400, None),
])
def test_hostile_load_bodies(server, body, status: int, param) -> None:
    got, _, out = request(server, "POST", "/v1/load_lora_adapter", body, AUTH)
    assert got == status, out
    err = assert_error_body(out)
    if param is not None:
        assert err["param"] == param


def test_rank_too_high_and_wrong_shapes_are_refused(server, models, tmp_path_factory) -> None:
    status, _, out = request(server, "POST", "/v1/load_lora_adapter",
                             {"lora_name": "ad3", "lora_path": str(models / "ad3")}, AUTH)
    assert status == 400 and "exceeds max_lora_rank 8" in out["error"]["message"]
    other = tmp_path_factory.mktemp("other")      # an adapter of another model: shapes differ
    make_adapter(make_base("qwen3", other / "base"), other / "qwen", seed=1, rank=4)
    status, _, out = request(server, "POST", "/v1/load_lora_adapter",
                             {"lora_name": "qwen", "lora_path": str(other / "qwen")}, AUTH)
    assert status == 200   # its config is fine; the core reads the weights at first use
    status, out = _complete(server, "qwen")
    assert status == 400 and "do not fit the base linear" in out["error"]["message"], out
    request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "qwen"}, AUTH)
    assert _complete(server, "ad0")[0] == 200            # nothing else disturbed


def test_metrics_count_per_adapter(server) -> None:
    _complete(server, "ad0")
    m = wait_idle(server)
    assert m['tessellm:lora_requests_total{adapter="ad0"}'] >= 1
    assert m['tessellm:lora_prompt_tokens_total{adapter="ad0"}'] >= len(PROMPT)
    assert m['tessellm:lora_generation_tokens_total{adapter="ad0"}'] >= 10
    assert 'tessellm:lora_requests_total{adapter="base"}' not in m


@pytest.mark.parametrize("args, message", [
    (["--lora-modules", "x=/tmp"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "x=/no/such/dir"], "does not exist"),
    (["--enable-lora", "--lora-modules", "justaname"], "must be name=path"),
])
def test_bad_lora_modules_stop_the_server_at_start(models, args, message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "tessellm.cli.main", "serve", "--model",
                           str(models / "base"), "--port", "0", "--kernel-selection", "first",
                           *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
