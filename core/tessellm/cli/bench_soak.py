"""`tessellm bench soak`: many mixed requests against one server, watching for leaks.

Starts `tessellm serve` on a free loopback port (or uses `--url` with `--server-pid`) and
sends `requests` requests from `concurrency` workers: a `hostile` fraction drawn from the
hostile catalogue (tessellm.testing.hostile_requests; each must get its stated answer), a
`disconnect` fraction of streams closed by the client after a few events, and ordinary
completions and chats (streamed or not, n of 1 or 2, 1..16 tokens). Every `report_every`
requests it prints one JSON line: throughput so far, the RSS and open descriptors of the
server and its engine core, the server's running / waiting / KV usage, answers by status, and
`unexpected` (a hostile request answered otherwise than stated, or any 5xx). The last line
adds `idle_after` (the server's gauges once the traffic stopped) and `ok`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # the catalogue and raw client are imported when a soak runs, not when
    from tessellm.testing.hostile_requests import HostileRequest   # the parser is built

WORDS = ("once upon a time there was a little dog who liked to play in the park with "
         "his friend the cat and one day they found a big red ball").split()


@dataclass
class SoakTally:
    statuses: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    done: int = 0


def _proc_figures(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open descriptors) of a process, from /proc."""
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    return round(rss_kb / 1024, 1), len(os.listdir(f"/proc/{pid}/fd"))


def _engine_core_pid(server_pid: int) -> int | None:
    """The server's engine-core child (not multiprocessing's resource tracker)."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"resource_tracker" not in cmdline:
                return int(child)
    return None


async def _gauges(session: Any, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    wanted = {"tessellm:num_requests_running": "running",
              "tessellm:num_requests_waiting": "waiting",
              "tessellm:kv_cache_usage_perc": "kv_usage"}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[wanted[name]] = float(value)
    return out


def _ordinary_body(rng: random.Random, chat: bool, stream: bool) -> dict[str, Any]:
    text = " ".join(rng.choices(WORDS, k=rng.randint(2, 24)))
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 16), "stream": stream,
                            "temperature": rng.choice([0.0, 0.8]), "n": rng.choice([1, 1, 2])}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


async def _ordinary(session: Any, url: str, rng: random.Random, headers: dict[str, str],
                    disconnect: bool, chat: bool, tally: SoakTally) -> None:
    body = _ordinary_body(rng, chat, stream=disconnect or rng.random() < 0.5)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(url + path, json=body, headers=headers) as resp:
        tally.statuses[resp.status] += 1
        if resp.status >= 500:
            tally.unexpected.append(f"{path} -> {resp.status}: {(await resp.text())[:200]}")
            return
        if disconnect:   # leave after a few events: the server must abort and free it
            events = rng.randint(0, 3)
            async for line in resp.content:
                if line.startswith(b"data:"):
                    events -= 1
                    if events < 0:
                        break
            resp.close()
            return
        text = await resp.text()
        if resp.status == 200 and body["stream"] and '"error"' in text:
            tally.unexpected.append(f"{path}: error event {text[-200:]}")


async def _hostile(host: str, port: int, case: HostileRequest, tally: SoakTally) -> None:
    from tessellm.testing.raw_http import send_raw
    answer = await send_raw(host, port, case.raw)
    tally.statuses[answer.status] += 1
    if answer.status != case.status:
        tally.unexpected.append(f"hostile {case.name}: {answer.status} (expected {case.status})"
                                f" {answer.body[:200]!r}")


async def run_soak(url: str, server_pid: int, requests: int, concurrency: int,
                   hostile: float, disconnect: float, report_every: int, max_queue: int,
                   api_key: str | None, seed: int = 0, out: Any = None) -> dict[str, Any]:
    """`out`: where the reports go (default: sys.stdout as it is at the call)."""
    import aiohttp
    from urllib.parse import urlsplit
    out = sys.stdout if out is None else out
    rng = random.Random(seed)
    parts = urlsplit(url)
    from tessellm.testing.hostile_requests import hostile_requests
    catalogue = hostile_requests(max_queue, api_key)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tally = SoakTally()
    counter = iter(range(requests))
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def figures() -> dict[str, Any]:
            core = _engine_core_pid(server_pid)
            server_rss, server_fds = _proc_figures(server_pid)
            core_rss, core_fds = _proc_figures(core) if core else (0.0, 0)
            line = {"requests": tally.done, "elapsed_s": round(time.monotonic() - t0, 1),
                    "req_per_s": round(tally.done / max(1e-9, time.monotonic() - t0), 1),
                    "server_rss_mib": server_rss, "core_rss_mib": core_rss,
                    "server_fds": server_fds, "core_fds": core_fds,
                    **await _gauges(session, url),
                    "statuses": dict(sorted(tally.statuses.items())),
                    "unexpected": len(tally.unexpected)}
            return line

        async def report() -> None:
            print(json.dumps(await figures()), file=out, flush=True)

        async def worker() -> None:
            for _ in counter:
                r = rng.random()
                try:
                    if r < hostile:
                        await _hostile(parts.hostname, parts.port, rng.choice(catalogue), tally)
                    else:
                        await _ordinary(session, url, rng, headers,
                                        r < hostile + disconnect, rng.random() < 0.5, tally)
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                    tally.unexpected.append(f"client error {type(e).__name__}: {e}")
                tally.done += 1
                if tally.done % report_every == 0:
                    await report()

        await report()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        deadline = time.monotonic() + 10
        idle = await _gauges(session, url)
        while any(idle.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            idle = await _gauges(session, url)
        final = await figures()
    final.update(idle_after=idle, ok=not tally.unexpected and not any(idle.values()),
                 first_unexpected=tally.unexpected[:10])
    print(json.dumps(final), file=out, flush=True)
    return final


def add_parser(bsub: Any) -> argparse.ArgumentParser:
    sk = bsub.add_parser("soak", help="many mixed requests (hostile ones, disconnects) against "
                         "a server, with its memory and descriptors every --report-every")
    sk.add_argument("--model", default=None, help="model of the server it starts (default: "
                    "the default model)")
    sk.add_argument("--serve-args", default="", help="more `tessellm serve` options, quoted")
    sk.add_argument("--url", default=None, help="a running server instead (needs --server-pid)")
    sk.add_argument("--server-pid", type=int, default=None)
    sk.add_argument("--api-key", default=None)
    sk.add_argument("--requests", type=int, default=20000)
    sk.add_argument("--concurrency", type=int, default=16)
    sk.add_argument("--hostile", type=float, default=0.1, help="fraction of hostile requests")
    sk.add_argument("--disconnect", type=float, default=0.05,
                    help="fraction of streams the client leaves early")
    sk.add_argument("--report-every", type=int, default=1000)
    sk.add_argument("--max-queue", type=int, default=64)
    sk.add_argument("--seed", type=int, default=0)
    return sk


def cmd_bench_soak(a: argparse.Namespace) -> int:
    """A server started here (or the one at --url), soaked; exit 1 on any unexpected answer."""
    import shlex

    from tessellm.cli.server_process import start_server, stop_server
    from tessellm.errors import TessellmError
    proc = None
    url, pid = a.url, a.server_pid
    if url is None:
        serve_args = ["--max-queue", str(a.max_queue), *shlex.split(a.serve_args)]
        if a.model:
            serve_args = ["--model", a.model, *serve_args]
        proc, url, _, log = start_server(serve_args)
        pid = proc.pid
        print(json.dumps({"server": url, "log": str(log)}), flush=True)
    elif pid is None:
        raise TessellmError("--url needs --server-pid (to read its memory and descriptors)")
    try:
        result = asyncio.run(run_soak(url, pid, a.requests, a.concurrency, a.hostile,
                                      a.disconnect, a.report_every, a.max_queue, a.api_key,
                                      a.seed))
    finally:
        if proc is not None:
            stop_server(proc)
    return 0 if result["ok"] else 1
