"""`serve_app(...)`: tessellm as a Ray Serve application, for users who already run Ray Serve.

Each Serve replica runs the whole tessellm server in-process (server.serve on an event loop
of its own thread, with one spawned engine core, on a loopback port) and `__call__` forwards
every HTTP request to it unchanged, streaming the answer back, so the OpenAI API, its
validation and errors are the `tessellm serve` ones. Serve routes between replicas; each
replica reports its engine's queue depth (open requests: running + waiting) through
`record_autoscaling_stats`, and the default autoscaling policy (`queue_depth_policy`) sizes
the deployment so that each replica holds about `target_ongoing_requests` of them. Ray Serve
ships in `ray[serve]` (the `tessellm[ray]` extra); a missing one is a ConfigError when the
application is built.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import threading
from typing import Any

from tessellm.errors import ConfigError
from tessellm.ray.cluster import RAY_EXTRA_HINT

QUEUE_DEPTH_METRIC = "tessellm_queue_depth"
POLICY = "tessellm.ray.serve_app:queue_depth_policy"
DEFAULT_AUTOSCALING = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8,
                       "policy": {"policy_function": POLICY}}
START_TIMEOUT_S = 600.0


def queue_depth_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Ray Serve custom autoscaling policy: replicas = ceil(the engines' summed queue depth /
    target_ongoing_requests), within the deployment's bounds (no metric yet: unchanged)."""
    depths = (ctx.aggregated_metrics or {}).get(QUEUE_DEPTH_METRIC, {})
    if not depths:
        return ctx.target_num_replicas, ctx.policy_state
    target = ctx.config.target_ongoing_requests or 1
    desired = math.ceil(sum(depths.values()) / target)
    return (max(ctx.capacity_adjusted_min_replicas,
                min(ctx.capacity_adjusted_max_replicas, desired)), ctx.policy_state)


class TessellmDeployment:
    """One Serve replica: a tessellm server on a loopback port, and a proxy to it."""

    def __init__(self, engine_json: str, server_json: str, model_option: str | None) -> None:
        from tessellm.config import EngineConfig
        from tessellm.models.source import model_source_of
        from tessellm.server.serve import read_chat_template, serve
        from tessellm.server.server_config import ServerConfig
        engine_config = EngineConfig.model_validate_json(engine_json)
        server_config = ServerConfig(**json.loads(server_json))
        source = model_source_of(engine_config)
        core_config = engine_config.model_copy(
            update={"model": str(source.path), "gguf_file": None, "revision": None})
        template = read_chat_template(server_config.chat_template)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True,
                         name="tessellm-serve-app").start()
        listening: concurrent.futures.Future = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self.state: Any = None

        async def main() -> int:
            self._stop = asyncio.Event()
            return await serve(core_config, source, model_option, server_config, template,
                               on_listening=lambda port, state: listening.set_result(
                                   (port, state)), stop=self._stop)

        self._server = asyncio.run_coroutine_threadsafe(main(), self._loop)
        done, _ = concurrent.futures.wait([listening, self._server], START_TIMEOUT_S,
                                          concurrent.futures.FIRST_COMPLETED)
        if listening not in done:
            self._server.result(0)   # raises the start-up error
            raise RuntimeError("the tessellm server did not start")
        self.port, self.state = listening.result()
        self._session: Any = None

    async def __call__(self, request: Any) -> Any:
        """Forward a Starlette request to the local server; stream its answer back."""
        import aiohttp
        from starlette.responses import StreamingResponse
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length")}
        url = f"http://127.0.0.1:{self.port}{request.url.path}"
        if request.url.query:
            url += f"?{request.url.query}"
        resp = await self._session.request(request.method, url, headers=headers,
                                           data=await request.body())

        async def body() -> Any:
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            finally:
                resp.release()

        return StreamingResponse(body(), status_code=resp.status, headers={
            k: v for k, v in resp.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding", "connection")})

    def record_autoscaling_stats(self) -> dict[str, float]:
        engine = self.state.engine
        return {QUEUE_DEPTH_METRIC: float(engine.num_open)}

    def check_health(self) -> None:
        if self._server.done() or not self.state.engine.is_alive:
            raise RuntimeError(f"the tessellm engine is not running: "
                               f"{self.state.engine.fatal_error or 'the server stopped'}")

    def __del__(self) -> None:
        if self._stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)


def serve_app(model: str | None = None, *, autoscaling_config: dict[str, Any] | None = None,
              num_replicas: int | str | None = None, ray_actor_options: dict | None = None,
              **options: Any) -> Any:
    """A Ray Serve application of tessellm servers: `serve.run(serve_app("path/to/model",
    num_threads=2))`. `options`: EngineConfig and ServerConfig fields (as in the YAML file;
    host and port are the replica's own, chosen here). Autoscaling by the engines' queue
    depth (DEFAULT_AUTOSCALING, `queue_depth_policy`) unless `num_replicas` is fixed or
    `autoscaling_config` given. ConfigError for bad options or a missing Ray Serve."""
    try:
        from ray import serve
    except ImportError as e:
        raise ConfigError(f"serve_app needs Ray Serve ({e}); {RAY_EXTRA_HINT}") from None
    from tessellm.server.server_config import build_configs
    if {"host", "port", "data_parallel_size"} & set(options):
        raise ConfigError("serve_app chooses host and port itself, and scales with Serve "
                          "replicas (num_replicas / autoscaling_config), not "
                          "data_parallel_size")
    engine, server = build_configs(options, {"model": model, "host": "127.0.0.1", "port": 0},
                                   source="serve_app options")
    threads = engine.num_threads or 1
    deployment_options: dict[str, Any] = {
        "ray_actor_options": ray_actor_options or {"num_cpus": threads},
        "max_ongoing_requests": server.max_queue}
    if num_replicas is not None:
        if autoscaling_config is not None:
            raise ConfigError("give num_replicas or autoscaling_config, not both")
        deployment_options["num_replicas"] = num_replicas
    else:
        deployment_options["autoscaling_config"] = autoscaling_config or DEFAULT_AUTOSCALING
    deployment = serve.deployment(TessellmDeployment, name="tessellm")
    server_fields = server.model_dump(mode="json")   # the API key unmasked: the replica's
    server_fields["api_key"] = None if server.api_key is None \
        else server.api_key.get_secret_value()
    return deployment.options(**deployment_options).bind(
        engine.model_dump_json(), json.dumps(server_fields), model)
