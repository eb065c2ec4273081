"""Helpers for the end-to-end server tests: a REAL `tessellm serve` process on a free loopback
port (it binds port 0 and prints its URL), plain-HTTP helpers and a /metrics parser.

Each test module starts its own server in a module-scoped fixture (`running_server`) and the
server is stopped with SIGTERM at the end (killed if it does not exit).
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from faulty_server import StepFaults

FAULTY_SERVER = Path(__file__).with_name("faulty_server.py")

URL_LINE = re.compile(rb"tessellm: serving .* on (http://[0-9.]+:\d+)")
STARTUP_TIMEOUT_S = 90.0
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname, parts.port

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait; returns the exit status (kills and fails if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"server did not exit on SIGTERM:\n{self.log()[-3000:]}")
        return self.proc.returncode


def _wait_for_url(proc: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        m = URL_LINE.search(log_path.read_bytes())
        if m:
            return m.group(1).decode()
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise AssertionError(f"server did not start:\n{log_path.read_text(errors='replace')}")


@contextlib.contextmanager
def running_server(workdir: Path, args: list[str], env: dict[str, str] | None = None,
                   faults: StepFaults | None = None) -> Iterator[ServerProcess]:
    """`tessellm serve args` on a free port; with `faults`, over an engine core that injects
    them (faulty_server.py, the tests' own launcher of the real server)."""
    log_path = workdir / "server.log"
    command = ([sys.executable, "-m", "tessellm.cli.main"] if faults is None
               else [sys.executable, str(FAULTY_SERVER), faults.to_json()])
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*command, "serve", "--host", "127.0.0.1", "--port", "0", *args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = None
    try:
        server = ServerProcess(proc, _wait_for_url(proc, log_path), log_path)
        deadline = time.monotonic() + 30
        while request(server, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, "server never became healthy"
            time.sleep(0.05)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def request(server: ServerProcess, method: str, path: str, body: Any = None,
            headers: dict[str, str] | None = None, raw: bytes | None = None
            ) -> tuple[int, dict[str, str], Any]:
    """One plain HTTP request; returns (status, headers, parsed JSON or text)."""
    host, port = server.host_port
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        text = resp.read().decode()
        ctype = resp.getheader("Content-Type", "")
        parsed = json.loads(text) if ctype.startswith("application/json") else text
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed
    finally:
        conn.close()


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


def metrics(server: ServerProcess) -> dict[str, float]:
    """/metrics as {"name{labels}": value} (comments skipped)."""
    status, _, text = request(server, "GET", "/metrics")
    assert status == 200
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def wait_idle(server: ServerProcess, timeout: float = 1.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is used; returns the last
    scrape (the caller asserts on it)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = (m["tessellm:num_requests_running"] == 0 and m["tessellm:num_requests_waiting"] == 0
                and m["tessellm:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.02)


def assert_error_body(body: Any) -> dict[str, Any]:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


def offline_text(llm: Any, prompt: str | list[int], params: Any) -> str:
    """The offline `LLM.generate` text for one prompt (what the server must answer)."""
    return llm.generate([prompt], params)[0].text


def open_stream(server: ServerProcess, body: dict) -> tuple[http.client.HTTPConnection,
                                                            http.client.HTTPResponse]:
    """A streaming /v1/completions request, its response headers read."""
    host, port = server.host_port
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def assert_killed_worker_ends_the_server(server: ServerProcess, pid: int, named: str,
                                         streams: int) -> None:
    """SIGKILL of a parallel worker while `streams` streams are open: each ends with a 500
    error event whose message contains `named` within 10 s, /health turns 503 and the
    server exits 1."""
    opened = [open_stream(server, {"prompt": "Once upon a time", "max_tokens": 400,
                                   "ignore_eos": True}) for _ in range(streams)]
    for _, resp in opened:
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for conn, resp in opened:
        events = sse_events(resp.read().decode())
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert named in err["message"] and err["code"] == 500, err
        conn.close()
    assert time.monotonic() - t0 < 10
    status, _, body = request(server, "GET", "/health")
    assert status == 503 and body["error"]["code"] in ("engine_unavailable", "shutting_down")
    assert server.proc.wait(30) == 1

