"""`tessellm serve` in a subprocess, for the benchmarks that drive a real server (soak,
startup): its URL line, starting it on a free port, stopping it with SIGTERM."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

URL_LINE = re.compile(r"tessellm: serving .* on (http://[0-9.]+:\d+) \(engine core pid (\d+)\)")


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen, str, int, Path]:
    """`tessellm serve --port 0 ...` in a subprocess: (process, url, core pid, log path)."""
    log_path = Path(tempfile.mkdtemp(prefix="tessellm-soak-")) / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tessellm.cli.main", "serve", "--host",
                                 "127.0.0.1", "--port", "0", *serve_args],
                                stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        m = URL_LINE.search(log_path.read_text(errors="replace"))
        if m:
            return proc, m.group(1), int(m.group(2)), log_path
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server did not start:\n{log_path.read_text(errors='replace')}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
