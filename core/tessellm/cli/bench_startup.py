"""`tessellm bench startup`: how long `tessellm serve` takes from process start to /health 200,
cold (a fresh cache: kernels profiled, tokenizer built) and warm (the cache the cold runs
left), median of several runs, with the server's own stage timeline (its `tessellm: [t s]`
progress lines) for the median run of each kind."""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tessellm.cli.server_process import URL_LINE, stop_server

STAGE_LINE = re.compile(r"^tessellm: \[(\d+\.\d+) s\] (.*)$", re.MULTILINE)
POLL_S = 0.02


def add_parser(bsub: Any) -> argparse.ArgumentParser:
    p = bsub.add_parser("startup", help="`tessellm serve` start-up: seconds to /health 200, "
                        "cold (fresh cache) and warm, with the stages' timeline")
    p.add_argument("--model", default=None, help="model to serve (default: the default model)")
    p.add_argument("--serve-args", default="", help="more `tessellm serve` options, quoted")
    p.add_argument("--runs", type=int, default=3, help="runs of each kind (median reported)")
    p.add_argument("--kinds", default="cold,warm", help="cold, warm or both (comma-separated)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    return p


def _health_ok(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def time_one_start(serve_args: list[str], cache_dir: Path, timeout_s: float
                   ) -> dict[str, Any]:
    """Start a server on a free port with `cache_dir` as its cache (its log there too);
    seconds from the spawn to /health 200, and its stage lines; the server is stopped
    before this returns."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    log_path = cache_dir / f"server-{time.monotonic_ns()}.log"
    env = {**os.environ, "TESSELLM_CACHE_DIR": str(cache_dir)}
    t0 = time.perf_counter()
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tessellm.cli.main", "serve", "--host",
                                 "127.0.0.1", "--port", "0", *serve_args],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = None
        while time.perf_counter() - t0 < timeout_s:
            if url is None:
                m = URL_LINE.search(log_path.read_text(errors="replace"))
                url = m.group(1) if m else None
            if url is not None and _health_ok(url):
                ready_s = time.perf_counter() - t0
                text = log_path.read_text(errors="replace")
                return {"ready_s": round(ready_s, 3),
                        "stages": [(float(t), what) for t, what in STAGE_LINE.findall(text)]}
            if proc.poll() is not None:
                break
            time.sleep(POLL_S)
        raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s:\n"
                           f"{log_path.read_text(errors='replace')[-4000:]}")
    finally:
        stop_server(proc)


def run_bench_startup(a: argparse.Namespace) -> dict[str, Any]:
    serve_args = shlex.split(a.serve_args) + (["--model", a.model] if a.model else [])
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    unknown = set(kinds) - {"cold", "warm"}
    if unknown or not kinds:
        raise ValueError(f"--kinds takes cold and/or warm, got {a.kinds!r}")
    root = Path(tempfile.mkdtemp(prefix="tessellm-startup-cache-"))
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        if "cold" in kinds:
            runs["cold"] = [time_one_start(serve_args, root / f"cold-{i}", a.timeout)
                            for i in range(a.runs)]
        if "warm" in kinds:
            warm = root / "warm"
            time_one_start(serve_args, warm, a.timeout)   # fills the cache; not counted
            runs["warm"] = [time_one_start(serve_args, warm, a.timeout)
                            for _ in range(a.runs)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report: dict[str, Any] = {"model": a.model or "default", "runs": a.runs}
    for kind, results in runs.items():
        times = [r["ready_s"] for r in results]
        median = statistics.median(times)
        at_median = min(results, key=lambda r: abs(r["ready_s"] - median))
        report[kind] = {"median_s": round(median, 2), "all_s": times,
                        "stages_of_median_run": at_median["stages"]}
    return report


def print_report(report: dict[str, Any]) -> None:
    print(json.dumps(report))
    for kind in ("cold", "warm"):
        if kind in report:
            r = report[kind]
            print(f"{kind}: ready after {r['median_s']:.2f} s (median of "
                  f"{', '.join(f'{t:.2f}' for t in r['all_s'])})", file=sys.stderr)
            for t, what in r["stages_of_median_run"]:
                print(f"    [{t:6.2f} s] {what}", file=sys.stderr)
