"""The gRPC service of `tessellm serve --grpc-port` against stories260K: the HTTP server's
engine path, validation, errors (as gRPC codes) and API key."""
from __future__ import annotations

import json
import time

import grpc
import pytest
from grpc_fixtures import stub_of
from server_fixtures import metrics, request, running_server, sse_events, wait_idle
from tessellm import SamplingParams
from tessellm.server.grpc import tessellm_pb2 as pb
from tessellm.server.grpc.client import bearer

KEY = "grpc-test-key"
AUTH = bearer(KEY)
HTTP_AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_dir):
    workdir = tmp_path_factory.mktemp("server-grpc")
    config = workdir / "serve.yaml"
    config.write_text(f"model: {stories_dir}\ndtype: float32\nkernel_selection: first\n"
                      f"max_num_seqs: 8\nmax_n: 4\nnum_threads: 1\n")
    with running_server(workdir, ["--config", str(config), "--grpc-port", "0",
                                  "--api-key", KEY]) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server):
    channel, stub = stub_of(server)
    with channel:
        yield stub


def _error(call) -> grpc.RpcError:
    """The RpcError a call (unary, or streaming: read to its end) fails with."""
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__next__"):
            list(result)
    return info.value


def test_health_needs_no_key_and_models_lists_the_model(stub):
    assert stub.Health(pb.HealthRequest()).status == "ok"
    models = stub.Models(pb.ModelsRequest(), metadata=AUTH).data
    assert [(m.id, m.owned_by, m.max_model_len) for m in models] == \
        [("stories260K-hf", "tessellm", 512)]


def test_missing_or_wrong_key_is_unauthenticated_with_the_http_message(server, stub):
    status, _, body = request(server, "GET", "/v1/models")
    assert status == 401
    for metadata in (None, bearer("wrong"), (("authorization", KEY),)):
        err = _error(lambda: stub.Models(pb.ModelsRequest(), metadata=metadata))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.details() == body["error"]["message"]
        err = _error(lambda: stub.Generate(pb.GenerateRequest(text=PROMPT),
                                           metadata=metadata))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def _http_stream(server, body: dict) -> tuple[list[str], dict]:
    status, _, text = request(server, "POST", "/v1/completions", headers=HTTP_AUTH, body={
        **body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200, text
    chunks = [json.loads(e) for e in sse_events(text) if e != "[DONE]"]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    return [t for t in texts if t], chunks[-1]["usage"]


def test_generate_stream_equals_the_http_stream(server, stub, offline):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.9, "seed": 11,
            "stop_token_ids": [], "top_k": 40}
    http_texts, http_usage = _http_stream(server, body)
    messages = list(stub.Generate(pb.GenerateRequest(text=PROMPT, max_tokens=24,
                                                     temperature=0.9, seed=11, top_k=40),
                                  metadata=AUTH))
    deltas, last = messages[:-1], messages[-1]
    assert [m.text for m in deltas if m.text] == http_texts
    assert {m.request_id for m in messages} == {messages[0].request_id}
    assert deltas[-1].finish_reason == "length" and all(not m.finish_reason for m in deltas[:-1])
    ids = [t for m in deltas for t in m.token_ids]
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.9,
                                                         seed=11, top_k=40))[0]
    assert ids == expected.token_ids and "".join(http_texts) == expected.text
    assert last.HasField("usage") and not last.text and not last.token_ids
    assert (last.usage.prompt_tokens, last.usage.completion_tokens,
            last.usage.total_tokens) == (http_usage["prompt_tokens"],
                                         http_usage["completion_tokens"],
                                         http_usage["total_tokens"])


def test_token_id_prompts_and_n_choices(stub, offline):
    ids = offline.encode(PROMPT)
    messages = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                                     max_tokens=6, temperature=0, n=2),
                                  metadata=AUTH))
    for index in (0, 1):
        mine = [m for m in messages[:-1] if m.index == index]
        assert "".join(m.text for m in mine) == offline.generate(
            [ids], SamplingParams(max_tokens=6, temperature=0))[0].text
        assert mine[-1].finish_reason == "length"
    assert messages[-1].usage.completion_tokens == 12


@pytest.mark.parametrize("fields, body", [
    ({"max_tokens": 0}, {"max_tokens": 0}),
    ({"temperature": -1.0}, {"temperature": -1.0}),
    ({"max_tokens": 600}, {"max_tokens": 600}),
    ({"n": 9}, {"n": 9}),
    ({"stop": [""]}, {"stop": [""]}),
])
def test_bad_requests_are_invalid_argument_with_the_http_message(server, stub, fields, body):
    status, _, answer = request(server, "POST", "/v1/completions", headers=HTTP_AUTH,
                                body={"prompt": PROMPT, **body})
    assert status == 400
    err = _error(lambda: stub.Generate(pb.GenerateRequest(text=PROMPT, **fields),
                                       metadata=AUTH))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == answer["error"]["message"]


def test_missing_prompt_unknown_model_and_bad_request_id(stub):
    err = _error(lambda: stub.Generate(pb.GenerateRequest(max_tokens=2), metadata=AUTH))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.details()
    err = _error(lambda: stub.Generate(pb.GenerateRequest(text=PROMPT, model="gpt-4"),
                                       metadata=AUTH))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "gpt-4" in err.details()
    err = _error(lambda: stub.Generate(pb.GenerateRequest(text=PROMPT, request_id="x" * 200),
                                       metadata=AUTH))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.details()


def test_abort_ends_the_stream_and_frees_kv_blocks(server, stub):
    err = _error(lambda: stub.Abort(pb.AbortRequest(request_id="nobody"), metadata=AUTH))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    call = stub.Generate(pb.GenerateRequest(text=PROMPT, request_id="abort-me", max_tokens=480,
                                            temperature=0, ignore_eos=True), metadata=AUTH)
    stream = iter(call)
    first = next(stream)
    assert first.request_id == "abort-me"
    assert metrics(server)["tessellm:kv_cache_usage_perc"] > 0
    stub.Abort(pb.AbortRequest(request_id="abort-me"), metadata=AUTH)
    rest = list(stream)
    assert rest[-2].finish_reason == "abort" and rest[-1].HasField("usage")
    assert rest[-1].usage.completion_tokens < 480
    assert call.code() == grpc.StatusCode.OK
    m = wait_idle(server, timeout=5.0)
    assert m["tessellm:kv_cache_usage_perc"] == 0 and m["tessellm:num_requests_running"] == 0
    # the handle is free again
    time.sleep(0.05)
    again = list(stub.Generate(pb.GenerateRequest(text=PROMPT, request_id="abort-me",
                                                  max_tokens=2), metadata=AUTH))
    assert again[-1].usage.completion_tokens == 2
