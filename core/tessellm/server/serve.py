"""Running the server: build the engine, bind, serve until SIGTERM/SIGINT, shut down cleanly.

Shutdown order (SIGTERM or SIGINT): new /v1 requests get 503 and the listening socket closes;
in-flight requests get up to `drain_timeout_s` to finish; the rest are aborted (streams get
an error event, waiting clients a 503), the engine thread stops, connections close; exit 0.
Binds 127.0.0.1 unless told otherwise; binding elsewhere without an API key logs a warning.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web

from tessellm.config import EngineConfig
from tessellm.engine.async_engine import AsyncEngine
from tessellm.engine.builder import build_engine_parts
from tessellm.engine.llm_engine import LLMEngine
from tessellm.errors import ConfigError
from tessellm.models.demo import DEMO_NOTICE
from tessellm.server.app import create_app
from tessellm.server.server_config import ServerConfig
from tessellm.server.state import ServerState
from tessellm.server.test_hooks import install_test_hooks

log = logging.getLogger(__name__)
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tfs rid=%{X-Request-Id}o'
CONNECTION_CLOSE_TIMEOUT_S = 5.0


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read chat template {path!r}: {e}") from e
    if not text.strip():
        raise ConfigError(f"chat template {path!r} is empty")
    return text


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_server(engine_config: EngineConfig, server_config: ServerConfig,
               environ: Mapping[str, str] | None = None) -> int:
    """Build the engine and serve until a termination signal; returns the exit status."""
    template = read_chat_template(server_config.chat_template)
    parts = build_engine_parts(engine_config)
    if parts.is_demo:
        print(f"[tessellm] {DEMO_NOTICE}", file=sys.stderr)
    engine = LLMEngine(parts)
    install_test_hooks(engine, parts.tokenizer, os.environ if environ is None else environ)
    return asyncio.run(serve(engine, engine_config.model, server_config, template))


async def serve(engine: LLMEngine, model_path: str | None, config: ServerConfig,
                chat_template: str | None = None) -> int:
    async_engine = AsyncEngine(engine, max_waiting=config.max_queue)
    state = ServerState.build(async_engine, config, model_path, chat_template)
    runner = web.AppRunner(create_app(state), handler_cancellation=True,
                           access_log_format=ACCESS_LOG_FORMAT,
                           shutdown_timeout=CONNECTION_CLOSE_TIMEOUT_S)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"cannot listen on {config.host}:{config.port}: {e}") from e
    port = runner.addresses[0][1]
    if not _is_loopback(config.host) and config.api_key is None:
        log.warning("listening on %s without an API key: anyone who can reach it may use it",
                    config.host)
    print(f"tessellm: serving {state.model_name!r} on {_url(config.host, port)}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    print("tessellm: shutting down (draining in-flight requests)", flush=True)
    state.draining = True
    await site.stop()
    await async_engine.shutdown(config.drain_timeout_s)
    await runner.cleanup()
    return 0
