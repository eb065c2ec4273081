"""The web page's server side without a browser: static files and their headers, the
dashboard's JSON (/api/dashboard) against a live in-thread engine core, its API key, and the
pieces it is computed from (kernel table, latency window, per-second history)."""
from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer
from faulty_server import StepFaults
from tessellm import LLM
from tessellm.engine.async_engine import AsyncEngine
from tessellm.engine.core_client import EngineCoreClient
from tessellm.models.source import ModelSource
from tessellm.server.app import create_app
from tessellm.server.dashboard import kernel_table
from tessellm.server.engine_history import EngineHistory
from tessellm.server.latency_window import RecentLatencies, nearest_rank
from tessellm.server.server_config import ServerConfig
from tessellm.server.state import ServerState
from tessellm.server.web_ui import STATIC_FILES, read_static_files

KEY = "dash-key"


def test_kernel_table_merges_consecutive_buckets_of_one_kernel():
    choices = {"linear|float32|T1|in=4": "a", "linear|float32|T2|in=4": "a",
               "linear|float32|T4|in=4": "b", "linear|float32|T8|in=4": "a",
               "linear|float32|T16|in=8": "a", "odd-key": "k"}
    table = kernel_table(choices)
    assert [(r["op"], r["dims"]) for r in table] == [("linear", "in=4"), ("linear", "in=8"),
                                                     ("odd-key", "")]
    runs = [(r["kernel"], r["from_tokens"], r["to_tokens"], r["buckets"])
            for r in table[0]["runs"]]
    assert runs == [("a", 1, 2, 2), ("b", 4, 4, 1), ("a", 8, 8, 1)]  # numeric, not text order
    assert table[2]["runs"][0]["kernel"] == "k"


def test_latency_window_percentiles_and_expiry():
    assert [nearest_rank([1.0, 2.0, 3.0, 4.0], p) for p in (25, 50, 51, 100)] == [1, 2, 3, 4]
    w = RecentLatencies(window_s=10.0, max_samples=100)
    assert w.summary(now=0.0).count == 0 and w.summary(now=0.0).to_json()["p50"] is None
    for i in range(1, 101):
        w.observe(i / 100, now=float(i) / 20)   # t = 0.05 .. 5.0
    s = w.summary(now=5.0)
    assert (s.count, s.percentiles[50], s.percentiles[90], s.percentiles[99]) == \
        (100, 0.5, 0.9, 0.99)
    assert w.summary(now=12.5).count == 51       # older than 10 s: gone (t = 2.5 is kept)
    w.observe(7.0, now=13.0)
    assert w.summary(now=13.0).percentiles[99] == 7.0
    bounded = RecentLatencies(window_s=100.0, max_samples=3)
    for v in (1.0, 2.0, 3.0, 4.0):
        bounded.observe(v, now=0.0)
    assert bounded.summary(now=0.0).count == 3 and bounded.summary(now=0.0).percentiles[50] == 3


def _fake_engine(generated: int, running: int = 0) -> SimpleNamespace:
    stats = SimpleNamespace(num_running=running, kv_usage=0.25, num_generated_tokens=generated,
                            num_prompt_tokens=0, prefix_cache_queries=0, prefix_cache_hits=0,
                            num_preemptions=0)
    return SimpleNamespace(stats=stats, num_waiting=0)


def test_history_rates_come_from_cumulative_counters():
    engine = _fake_engine(0)
    h = EngineHistory(engine, interval_s=1.0, max_samples=3)
    for t, generated in ((100.0, 0), (101.0, 30), (103.0, 90), (104.0, 100)):
        engine.stats.num_generated_tokens = generated
        h.sample(now=t)
    points = h.points()   # 3 samples kept; the first has no interval
    assert [(p["t"], p["gen_tps"]) for p in points] == [(103.0, 30.0), (104.0, 10.0)]
    assert points[0]["kv_usage"] == 0.25


def test_static_files_ship_and_reference_only_each_other():
    files = read_static_files()
    assert set(files) == set(STATIC_FILES)
    html = files["index.html"].decode()
    refs = set(re.findall(r'(?:src|href)="/ui/([^"]+)"', html))
    for name, body in files.items():
        if name.endswith(".js"):
            refs |= set(re.findall(r'from "\./([^"]+)"', body.decode()))
    assert refs and refs <= set(STATIC_FILES), refs - set(STATIC_FILES)
    assert not re.search(r'(?:src|href)="(?:https?:)?//', html)   # nothing from elsewhere
    for name, body in files.items():
        if name.endswith(".js"):   # model and client text only ever goes in as text
            text = body.decode()
            for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write",
                         "eval(", "new Function"):
                assert sink not in text, (name, sink)


async def _app_client(stories_dir, api_key: str | None = None
                      ) -> tuple[TestClient, LLM, ServerState]:
    llm = LLM(str(stories_dir), dtype="float32", kernel_selection="first", load_progress=False,
              max_num_batched_tokens=64, max_num_seqs=1, priority_levels=3)
    StepFaults(delay_s=0.02).install(llm.engine, llm.tokenizer)
    core = EngineCoreClient.in_thread(llm.engine)
    await core.wait_ready()
    engine = AsyncEngine(core, llm.tokenizer)
    source = ModelSource("hf_dir", stories_dir, "stories260K-hf")
    state = ServerState.build(engine, llm.tokenizer, ServerConfig(api_key=api_key), source, None)
    return TestClient(TestServer(create_app(state))), llm, state


async def _wait_for(client: TestClient, predicate, timeout: float = 10.0,
                    headers: dict | None = None) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        snap = await (await client.get("/api/dashboard", headers=headers)).json()
        if predicate(snap):
            return snap
        assert asyncio.get_running_loop().time() < deadline, snap
        await asyncio.sleep(0.05)


def test_page_files_are_served_with_a_same_origin_policy(stories_dir):
    async def run() -> None:
        client, _, _ = await _app_client(stories_dir, api_key=KEY)
        async with client:
            page = await client.get("/")   # the page itself needs no key
            assert page.status == 200 and page.content_type == "text/html"
            csp = page.headers["Content-Security-Policy"]
            assert "default-src 'none'" in csp and "script-src 'self'" in csp
            assert "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
            assert "Access-Control-Allow-Origin" not in page.headers
            js = await client.get("/ui/main.js")
            assert js.status == 200 and js.content_type == "text/javascript"
            assert js.headers["X-Content-Type-Options"] == "nosniff"
            for bad in ("/ui/../app.py", "/ui/app.py", "/ui/%2e%2e/app.py", "/ui/"):
                assert (await client.get(bad)).status == 404, bad
            assert (await client.get("/api/dashboard")).status == 401
            ok = await client.get("/api/dashboard", headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status == 200 and ok.headers["Cache-Control"] == "no-store"
            assert "Access-Control-Allow-Origin" not in ok.headers

    asyncio.run(run())


def test_dashboard_reports_priorities_preemption_latencies_and_finishes(stories_dir):
    """One running slot: a priority-2 request runs, a priority-0 one arrives and evicts it
    (priority is preemptive); the snapshot shows each in its class, then the counters."""
    async def run() -> None:
        client, llm, state = await _app_client(stories_dir)
        async with client:
            snap = await (await client.get("/api/dashboard")).json()
            e = snap["engine"]
            assert (e["device"], e["plugin"], e["alive"]) == ("cpu", "cpu", True)
            assert e["plugin_version"] and e["priority_levels"] == 3
            ops = {row["op"] for row in snap["kernels"]}
            assert {"linear", "attention_decode", "attention_prefill"} <= ops
            assert snap["requests"]["finished"] == {"stop": 0, "length": 0, "abort": 0,
                                                    "error": 0}
            assert snap["kv"]["blocks_total"] == llm.engine.kv.num_blocks
            prompt = "Once upon a time, a little girl named Lily went to the park. " * 3
            assert len(llm.encode(prompt)) > 2 * llm.engine.parts.config.block_size
            body = {"prompt": prompt, "max_tokens": 60, "ignore_eos": True, "temperature": 0}
            low = asyncio.ensure_future(client.post("/v1/completions",
                                                    json={**body, "priority": 2}))
            await _wait_for(client, lambda s: s["requests"]["by_priority"][2]["running"] == 1)
            high = asyncio.ensure_future(client.post("/v1/completions",
                                                     json={**body, "priority": 0}))
            snap = await _wait_for(
                client, lambda s: s["requests"]["by_priority"][0]["running"] == 1
                and s["requests"]["by_priority"][2]["waiting"] == 1)
            assert snap["requests"]["by_priority"][1] == {"priority": 1, "running": 0,
                                                          "waiting": 0}
            assert snap["preemptions"] >= 1 and snap["kv"]["blocks_used"] >= 1
            for task in (low, high):
                assert (await task).status == 200
            snap = await _wait_for(client, lambda s: s["requests"]["finished"]["length"] == 2
                                   and s["requests"]["running"] == 0)
            assert snap["tokens"]["generated"] >= 120
            assert snap["latency"]["ttft"]["count"] == 2 and snap["latency"]["tpot"]["count"] == 2
            tpot = snap["latency"]["tpot"]
            assert 0.02 <= tpot["p50"] <= tpot["p99"] < 5   # every step sleeps 20 ms
            # the second request waited behind the first's prefill: its TTFT is the larger
            assert snap["latency"]["ttft"]["p99"] >= snap["latency"]["ttft"]["p50"] > 0
            # the second request found the first's full prompt blocks in the prefix cache
            cache = snap["prefix_cache"]
            assert cache["hits"] >= 2 * llm.engine.parts.config.block_size
            assert cache["hit_rate"] == pytest.approx(cache["hits"] / cache["queries"])
            assert snap["history"]["interval_s"] == 1.0
            state.engine._die("boom")   # as if the core had died
            snap = await (await client.get("/api/dashboard")).json()
            assert (snap["engine"]["alive"], snap["engine"]["fatal_error"]) == (False, "boom")

    asyncio.run(run())
