"""Running the server: build the engine, bind, serve until SIGTERM/SIGINT, shut down cleanly.

Shutdown order (SIGTERM or SIGINT): new /v1 requests get 503 and the listening socket closes;
in-flight requests get up to `drain_timeout_s` to finish; the rest are aborted (streams get
an error event, waiting clients a 503), the engine core stops, connections close; exit 0.
With --grpc-port the gRPC service (server/grpc) runs on the same event loop over the same
ServerState: it drains with HTTP and is closed after the engine stopped.
When the engine core dies instead, every open stream ends with an error at once, /health
answers 503, and the server exits with status 1 so that a supervisor restarts it.
Binds 127.0.0.1 unless told otherwise; binding elsewhere without an API key logs a warning.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from tessellm.config import EngineConfig
from tessellm.engine.async_engine import AsyncEngine
from tessellm.engine.core_client import CoreEntry, EngineCoreClient
from tessellm.errors import ConfigError
from tessellm.models.demo import DEMO_NOTICE
from tessellm.models.source_tokenizer import load_source_tokenizer
from tessellm.models.source import ModelSource, model_source_of
from tessellm.paths import cache_root
from tessellm.engine.core_liveness import LivenessConfig
from tessellm.engine.startup_progress import StartupProgress
from tessellm.server.app import create_app
from tessellm.server.connections import ConnectionGuard, GuardedTCPSite, connection_cap
from tessellm.server.grpc.server import grpc_address, load_grpc_service
from tessellm.server.server_config import ServerConfig
from tessellm.server.state import ServerState
from tessellm.server.tracing.setup import load_tracer

log = logging.getLogger(__name__)
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tfs rid=%{X-Request-Id}o'
CONNECTION_CLOSE_TIMEOUT_S = 5.0
DEATH_GRACE_S = 1.0  # after the core died: still listening, so health checks see the 503
LINGERING_S = 2.0    # after an answer to an unread body (408, 413): drain it this long, close


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


def _import_transformers() -> None:
    from transformers import AutoTokenizer  # noqa: F401  (a second: paid while the core starts)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def start_core(core_config: EngineConfig, source: ModelSource, config: ServerConfig,
                     liveness: LivenessConfig, progress: StartupProgress,
                     core_entry: CoreEntry | None = None) -> tuple[AsyncEngine, Any]:
    """Spawn the one engine core and load the tokenizer: (its AsyncEngine, not started yet;
    the tokenizer)."""
    loop = asyncio.get_running_loop()
    progress.stage("starting the engine core")
    core = EngineCoreClient.spawn(core_config, core_entry)
    try:
        # the front end imports transformers while the core loads; the core builds the
        # tokenizer (and saves it to the cache), so the front end's is a read of that copy
        await asyncio.gather(loop.run_in_executor(None, _import_transformers),
                             core.wait_ready())
        progress.stage("loading the tokenizer")
        tokenizer = await loop.run_in_executor(
            None, load_source_tokenizer, source, None, cache_root(core_config.cache_dir))
    except BaseException:
        await loop.run_in_executor(None, core.close)
        raise
    return AsyncEngine(core, tokenizer, max_waiting=config.max_queue, liveness=liveness), \
        tokenizer


async def start_replicas(core_config: EngineConfig, source: ModelSource, config: ServerConfig,
                         liveness: LivenessConfig, progress: StartupProgress
                         ) -> tuple[Any, Any]:
    """--data-parallel-size N: N engine cores as Ray actors (tessellm.ray), routed by one
    ReplicaSet: (the set, not started yet; the tokenizer). Ray missing, tensor parallelism or
    a replica that cannot start is an error here, before the server listens."""
    from tessellm.ray.cluster import import_ray
    from tessellm.ray.replica_set import ReplicaOptions, ReplicaSet, check_engine_config
    options = ReplicaOptions(config.data_parallel_size, core_config.ray_address, config.dp_routing,
                             config.replica_max_restarts)
    check_engine_config(core_config)
    import_ray()
    loop = asyncio.get_running_loop()
    progress.stage("loading the tokenizer")
    tokenizer = await loop.run_in_executor(
        None, load_source_tokenizer, source, None, cache_root(core_config.cache_dir))
    progress.stage(f"starting {options.size} engine-core replicas on Ray")

    def make_engine(core: EngineCoreClient, name: str, on_outputs: Any) -> AsyncEngine:
        return AsyncEngine(core, tokenizer, max_waiting=config.max_queue, liveness=liveness,
                           name=name, on_outputs=on_outputs)

    return await ReplicaSet.launch(core_config, options, make_engine), tokenizer


def engines_line(engine: Any) -> str:
    """What the start-up line says of the engine cores: their pids (and replica names)."""
    members = engine.members
    if len(members) == 1 and not members[0][0]:
        return f"engine core pid {members[0][1].core.pid}"
    return ", ".join(f"{name} pid {e.core.pid}" for name, e in members)


def run_server(engine_config: EngineConfig, server_config: ServerConfig,
               core_entry: CoreEntry | None = None) -> int:
    """Start the engine core and serve until a termination signal (0) or the core's death
    (1, so that a supervisor restarts the server); returns the exit status. `core_entry` is
    the core process's target (EngineCoreClient.spawn's; default the real core's)."""
    template = read_chat_template(server_config.chat_template)
    source = model_source_of(engine_config)   # a hub download happens once, here
    if source.is_demo:
        print(f"[tessellm] {DEMO_NOTICE}", file=sys.stderr)
    core_config = engine_config.model_copy(
        update={"model": str(source.path), "gguf_file": None, "revision": None})
    return asyncio.run(serve(core_config, source, engine_config.model, server_config, template,
                             core_entry))


async def serve(core_config: EngineConfig, source: ModelSource, model_option: str | None,
                config: ServerConfig, chat_template: str | None = None,
                core_entry: CoreEntry | None = None,
                on_listening: Callable[[int, ServerState], None] | None = None,
                stop: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT, or until `stop` is set when one is given (then no signal
    handler is installed: an embedding's thread, e.g. a Ray Serve replica, owns them).
    `on_listening(port, state)` is called once the server listens."""
    loop = asyncio.get_running_loop()
    # optional extras are checked before anything starts: a missing one is a start-up error
    grpc_runner_class = load_grpc_service() if config.grpc_port is not None else None
    tracer = load_tracer(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None
    if config.lora_modules and not core_config.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora (enable_lora: true)")
    progress = StartupProgress()
    liveness = LivenessConfig(config.engine_heartbeat_timeout_s, config.engine_stall_timeout_s)
    if config.data_parallel_size > 1:
        async_engine, tokenizer = await start_replicas(core_config, source, config, liveness,
                                                       progress)
    else:
        async_engine, tokenizer = await start_core(core_config, source, config, liveness,
                                                   progress, core_entry)
    try:   # an adapter of --lora-modules that cannot be served stops the server here
        state = ServerState.build(async_engine, tokenizer, config, source, model_option,
                                  chat_template)
    except BaseException:
        await async_engine.shutdown(0.0)
        raise
    state.tracer = tracer
    handler_options = {"access_log_format": ACCESS_LOG_FORMAT,
                       "keepalive_timeout": config.keepalive_timeout_s,
                       "lingering_time": LINGERING_S}
    guard = ConnectionGuard(connection_cap(config.max_connections), config.header_timeout_s,
                            handler_options)
    runner = web.AppRunner(create_app(state, guard), handler_cancellation=True,
                           shutdown_timeout=CONNECTION_CLOSE_TIMEOUT_S, **handler_options)
    await runner.setup()
    site = GuardedTCPSite(runner, config.host, config.port, guard)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"cannot listen on {config.host}:{config.port}: {e}") from e
    port = runner.addresses[0][1]
    grpc_runner = None
    if grpc_runner_class is not None:
        grpc_runner = grpc_runner_class(state, config.host, config.grpc_port or 0)
        try:
            await grpc_runner.start()
        except ConfigError:
            await runner.cleanup()
            raise
        print(f"tessellm: gRPC on {grpc_address(config.host, grpc_runner.port)}", flush=True)
    if not _is_loopback(config.host) and config.api_key is None:
        log.warning("listening on %s without an API key: anyone who can reach it may use it",
                    config.host)
    print(f"tessellm: serving {state.model_name!r} on {_url(config.host, port)} "
          f"({engines_line(async_engine)})", flush=True)

    if on_listening is not None:
        on_listening(port, state)
    signals = () if stop is not None else (signal.SIGTERM, signal.SIGINT)
    stop = stop or asyncio.Event()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    signalled, died = asyncio.ensure_future(stop.wait()), \
        asyncio.ensure_future(async_engine.wait_dead())
    try:
        await asyncio.wait({signalled, died}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        signalled.cancel()
    core_died = died.done()
    if core_died:
        print(f"tessellm: the engine core died ({async_engine.fatal_error}); every open "
              "request was failed; exiting with status 1", file=sys.stderr, flush=True)
        await asyncio.sleep(DEATH_GRACE_S)  # /health answers 503 (engine_unavailable) meanwhile
    else:
        died.cancel()
        print("tessellm: shutting down (draining in-flight requests)", flush=True)
    state.draining = True
    await site.stop()
    await async_engine.shutdown(0.0 if core_died else config.drain_timeout_s)
    if grpc_runner is not None:   # its calls ended with the engine's streams: flush, close
        await grpc_runner.stop(CONNECTION_CLOSE_TIMEOUT_S)
    await runner.cleanup()
    if tracer is not None:   # exports what is buffered (blocking: off the loop)
        await loop.run_in_executor(None, tracer.shutdown)
    return 1 if core_died else 0
