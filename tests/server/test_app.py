"""The app in-process (aiohttp's test server): /health states and per-app metric registries."""
from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer
from tessellm import LLM
from tessellm.engine.async_engine import AsyncEngine
from tessellm.engine.core_client import EngineCoreClient
from tessellm.server.app import create_app
from tessellm.server.metrics import ServerMetrics
from tessellm.server.server_config import ServerConfig
from tessellm.models.source import ModelSource
from tessellm.server.state import ServerState, model_aliases


def test_model_names(tmp_path):
    source = ModelSource("gguf", tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf",
                         "SmolLM2-135M-Instruct.Q4_1")
    names = model_aliases(None, source)
    assert "SmolLM2-135M-Instruct.Q4_1" in names and str(source.path) in names
    repo = ModelSource("hf_dir", tmp_path / "snap", "org/name")
    assert {"org/name", str(tmp_path / "snap")} <= model_aliases("org/name", repo)


async def _thread_engine(stories_dir) -> tuple[AsyncEngine, LLM]:
    """An AsyncEngine over an engine core on a thread of this process (inproc sockets)."""
    llm = LLM(str(stories_dir), dtype="float32", kernel_selection="first", load_progress=False,
              max_num_batched_tokens=64, max_num_seqs=4)
    core = EngineCoreClient.in_thread(llm.engine)
    await core.wait_ready()
    return AsyncEngine(core, llm.tokenizer), llm


def test_each_app_has_its_own_registry(stories_dir):
    async def run() -> None:
        engine, _ = await _thread_engine(stories_dir)
        a, b = ServerMetrics(engine), ServerMetrics(engine)
        a.ttft.observe(0.5)
        assert b"tessellm:time_to_first_token_seconds_count 1.0" in a.render()
        assert b"tessellm:time_to_first_token_seconds_count 0.0" in b.render()
        await engine.shutdown()

    asyncio.run(run())


def test_health_follows_the_engine_core_and_draining(stories_dir):
    async def run() -> None:
        engine, llm = await _thread_engine(stories_dir)
        source = ModelSource("hf_dir", stories_dir, "stories260K-hf")
        state = ServerState.build(engine, llm.tokenizer, ServerConfig(), source, None)
        async with TestClient(TestServer(create_app(state))) as client:
            assert (await client.get("/health")).status == 200
            state.draining = True
            resp = await client.get("/health")
            body = await resp.json()
            assert resp.status == 503 and "shutting down" in body["error"]["message"]
            assert body["error"]["code"] == "shutting_down"
            resp = await client.post("/v1/completions", json={"prompt": "x"})
            assert resp.status == 503 and resp.headers["Retry-After"]
            state.draining = False
            engine._die("boom")  # as if the core had died
            resp = await client.get("/health")
            body = await resp.json()
            assert resp.status == 503 and "boom" in body["error"]["message"]
            assert body["error"]["code"] == "engine_unavailable"
            resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            body = await resp.json()  # dead engine: 503, and not "queue full"
            assert resp.status == 503 and body["error"]["code"] == "engine_unavailable"
        assert not engine.is_alive

    asyncio.run(run())
