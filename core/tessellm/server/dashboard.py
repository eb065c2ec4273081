"""GET /api/dashboard: one JSON snapshot of the engine for the web page's dashboard.

What it reads: the engine core's Ready message (device, plugin, dtype, the kernel chosen per
profiled (op, dtype, token bucket, dims) key), the core's latest CoreStats (running/waiting
per priority class, KV blocks, prefix cache, counters), the front end's liveness, the
server's metrics (finished sequences per reason, TTFT/TPOT over the last minutes) and the
EngineHistory's one-per-second samples; behind a replica set (tessellm.ray) also one row per
replica (state, pid, load, KV usage, prefix-cache hits), the totals being the replicas' sums. Reading it never touches the engine's queue. Behind
the API key like /v1/* (it names the model, device and load), same origin only (no CORS
headers: a page elsewhere cannot read it).
"""
from __future__ import annotations

import dataclasses
import time
from itertools import groupby
from typing import Any

from aiohttp import web

from tessellm.server.requests import STATE_KEY
from tessellm.server.state import ServerState
from tessellm.speculative.stats import SpecStats

DASHBOARD_PATH = "/api/dashboard"


def kernel_table(choices: dict[str, str]) -> list[dict[str, Any]]:
    """Ready.kernel_choices ("op|dtype|T<bucket>|dims" -> kernel) as one row per (op, dtype,
    dims), sorted, each with `runs`: maximal runs of consecutive token buckets (ascending)
    that chose the same kernel. A key of another shape is kept as its own row (op = the key)."""
    rows: dict[tuple[str, str, str], list[tuple[int, str]]] = {}
    for key, kernel in choices.items():
        parts = key.split("|", 3)
        if len(parts) == 4 and parts[2].startswith("T") and parts[2][1:].isdigit():
            op, dtype, bucket, dims = parts
            rows.setdefault((op, dtype, dims), []).append((int(bucket[1:]), kernel))
        else:
            rows.setdefault((key, "", ""), []).append((0, kernel))
    table = []
    for (op, dtype, dims), entries in sorted(rows.items()):
        entries.sort()
        runs = []
        for kernel, run in groupby(entries, key=lambda e: e[1]):
            buckets = [b for b, _ in run]
            runs.append({"kernel": kernel, "from_tokens": buckets[0], "to_tokens": buckets[-1],
                         "buckets": len(buckets)})
        table.append({"op": op, "dtype": dtype, "dims": dims, "runs": runs})
    return table


def speculative_section(s: Any) -> dict[str, Any] | None:
    """Speculative decoding's counters (None when the engine does not speculate)."""
    st = SpecStats.from_wire(s)
    if st is None:
        return None
    return {**dataclasses.asdict(st),
            "acceptance_rate": st.acceptance_rate if st.draft_tokens else None,
            "mean_accepted_length": st.mean_accepted_length if st.verify_steps else None}


def replica_rows(engine: Any) -> list[dict[str, Any]]:
    """One row per replica behind a replica set (tessellm.ray); none for a single engine."""
    members = engine.members
    if len(members) == 1 and not members[0][0]:
        return []
    return [{"name": name, "alive": e.is_alive,
             "responsive": e.is_alive and e.unresponsive_reason is None,
             "core_pid": e.info.pid, "fatal_error": e.fatal_error,
             "running": e.stats.num_running, "waiting": e.num_waiting,
             "kv_usage": e.stats.kv_usage, "prefix_cache_hits": e.stats.prefix_cache_hits,
             "prefix_cache_queries": e.stats.prefix_cache_queries} for name, e in members]


def snapshot(state: ServerState) -> dict[str, Any]:
    engine, info, m = state.engine, state.engine.info, state.metrics
    s = engine.stats
    levels = info.priority_levels
    running = list(s.running_by_priority) or [0] * levels
    waiting = list(s.waiting_by_priority) or [0] * levels
    history = state.history
    hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else None
    return {
        "time": time.time(),
        "model": {"name": state.model_name, "max_model_len": state.max_model_len},
        "engine": {
            "device": info.device, "plugin": info.plugin, "plugin_version": info.plugin_version,
            "dtype": info.dtype, "core_pid": info.pid, "alive": engine.is_alive,
            "fatal_error": engine.fatal_error, "draining": state.draining,
            "last_report_age_s": time.monotonic() - engine.last_heard,
            "weight_bytes": info.weight_bytes, "block_size": info.block_size,
            "priority_levels": levels},
        "kernels": kernel_table(info.kernel_choices),
        "requests": {
            "running": s.num_running, "waiting": engine.num_waiting,
            "by_priority": [{"priority": p, "running": running[p], "waiting": waiting[p]}
                            for p in range(min(levels, len(running), len(waiting)))],
            "finished": m.finished_counts()},
        "kv": {"blocks_total": info.num_kv_blocks,
               "blocks_used": round(s.kv_usage * info.num_kv_blocks), "usage": s.kv_usage},
        "prefix_cache": {"queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits,
                         "hit_rate": hit_rate},
        "tokens": {"prompt": s.num_prompt_tokens, "generated": s.num_generated_tokens,
                   "gen_tps": history.recent_rate("generation_tokens"),
                   "prompt_tps": history.recent_rate("prompt_tokens")},
        "speculative": speculative_section(s),
        "preemptions": s.num_preemptions,
        "steps": s.num_steps,
        "latency": {"window_s": m.recent_ttft.window_s,
                    "ttft": m.recent_ttft.summary().to_json(),
                    "tpot": m.recent_tpot.summary().to_json()},
        "history": {"interval_s": history.interval_s, "points": history.points()},
        "replicas": replica_rows(engine),
    }


async def dashboard(request: web.Request) -> web.Response:
    return web.json_response(snapshot(request.app[STATE_KEY]),
                             headers={"Cache-Control": "no-store"})
