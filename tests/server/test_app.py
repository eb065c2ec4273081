"""The app in-process (aiohttp's test server): /health states and per-app metric registries."""
from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer
from tessellm.engine.async_engine import AsyncEngine
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


def test_each_app_has_its_own_registry(offline):
    engine = AsyncEngine(offline.engine)
    a, b = ServerMetrics(engine), ServerMetrics(engine)
    a.ttft.observe(0.5)
    assert b"tessellm:time_to_first_token_seconds_count 1.0" in a.render()
    assert b"tessellm:time_to_first_token_seconds_count 0.0" in b.render()


def test_health_follows_the_engine_thread_and_draining(offline):
    async def run() -> None:
        engine = AsyncEngine(offline.engine)
        state = ServerState.build(engine, ServerConfig(), "/x/stories260K-hf")
        async with TestClient(TestServer(create_app(state))) as client:
            assert (await client.get("/health")).status == 200
            state.draining = True
            resp = await client.get("/health")
            assert resp.status == 503 and "shutting down" in (await resp.json())["error"][
                "message"]
            resp = await client.post("/v1/completions", json={"prompt": "x"})
            assert resp.status == 503 and resp.headers["Retry-After"]
            state.draining = False
            engine.fatal_error = RuntimeError("boom")  # as if the engine thread had died
            resp = await client.get("/health")
            assert resp.status == 503 and "boom" in (await resp.json())["error"]["message"]
        assert not engine.is_alive

    asyncio.run(run())
