"""ReplicaSet: N engine-core actors behind one front end, as one engine for the server.

It answers what the server asks of an AsyncEngine (`info`, `stats`, `add_request_group`,
liveness, `start`/`shutdown`/`wait_dead`, `members` for per-replica metrics) and routes each
request (Router) to a replica in rotation; the request's stream is that replica's
AsyncEngine's, so aborts, stop strings and errors take the single engine's path. Invariants:
only replicas in rotation get requests; `stats` is the sum of the replicas' latest reports;
the set is alive while any replica is not dead for good, and `wait_dead` returns (the server
then exits 1) only when every replica is. Replicas are started together; one failing to
start fails the start-up (every actor is killed).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from tessellm.config import EngineConfig
from tessellm.engine.async_engine import (AsyncEngine, EngineDeadError, EngineObserver,
                                          EngineUnresponsiveError, RequestStream)
from tessellm.engine.core_client import EngineCoreClient
from tessellm.engine.core_liveness import CoreLiveness, LivenessConfig
from tessellm.engine.core_messages import CoreStats, Ready, StepOutputs
from tessellm.errors import ConfigError
from tessellm.ray.actor import actor_class
from tessellm.ray.cluster import import_ray, join_cluster, reachable_host
from tessellm.ray.prefix_index import prompt_hashes
from tessellm.ray.replica import Replica
from tessellm.ray.router import Candidate, Router
from tessellm.sampling_params import SamplingParams

DEFAULT_MAX_RESTARTS = 3


@dataclasses.dataclass(frozen=True)
class ReplicaOptions:
    """How the replicas are deployed (the server's --data-parallel-* flags)."""

    size: int
    ray_address: str | None = None
    routing: str = "least-loaded"
    max_restarts: int = DEFAULT_MAX_RESTARTS

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ConfigError(f"--data-parallel-size must be an integer >= 1, got {self.size!r}")
        if self.max_restarts < 0:
            raise ConfigError(f"replica max restarts must be >= 0, got {self.max_restarts}")
        Router(self.routing)   # an unknown policy is a ConfigError here


def check_engine_config(config: EngineConfig) -> None:
    """What replicas cannot do yet, refused before anything starts."""
    if config.tensor_parallel_size > 1:
        raise ConfigError("--data-parallel-size > 1 with --tensor-parallel-size > 1 is not "
                          "supported: each replica is one engine core on one device")
    if config.pipeline_parallel_size > 1:
        raise ConfigError("--data-parallel-size > 1 with --pipeline-parallel-size > 1 is not "
                          "supported: each replica is one engine core on one device")


def _sum_stats(stats: list[CoreStats]) -> CoreStats:
    """The replicas' reports as one: counts summed (per priority class, per adapter), KV
    usage averaged (the replicas' pools are alike), stage seconds and device counters
    summed."""
    total = CoreStats()
    for s in stats:
        for f in CoreStats.__struct_fields__:
            value = getattr(s, f)
            if isinstance(value, int):
                setattr(total, f, getattr(total, f) + value)
        total.spec_method = total.spec_method or s.spec_method
        for f in ("stage_seconds", "device_counters"):
            merged = getattr(total, f)
            for key, value in getattr(s, f).items():
                merged[key] = merged.get(key, 0.0) + value
        for name, counts in s.lora_counts.items():
            mine = total.lora_counts.setdefault(name, [0] * len(counts))
            total.lora_counts[name] = [a + b for a, b in zip(mine, counts)]
        for f in ("running_by_priority", "waiting_by_priority"):
            a, b = getattr(total, f), getattr(s, f)
            setattr(total, f, [x + y for x, y in zip(a, b)] if a else list(b))
    if stats:
        total.kv_usage = sum(s.kv_usage for s in stats) / len(stats)
    return total


class ReplicaSet:
    def __init__(self, replicas: list[Replica], router: Router, owns_ray: bool) -> None:
        self.replicas = replicas
        self.router = router
        self._owns_ray = owns_ray
        self._observer: EngineObserver | None = None
        self._tasks: list[asyncio.Task] = []
        self._dead = asyncio.Event()
        self._stopping = False
        for r in replicas:
            r.changed = self._replica_changed

    # ---- construction ------------------------------------------------------------------

    @classmethod
    async def launch(cls, config: EngineConfig, options: ReplicaOptions,
                     make_engine: Callable[[EngineCoreClient, str,
                                            Callable[[StepOutputs], None]], AsyncEngine]
                     ) -> ReplicaSet:
        """Join or start the Ray cluster, create the actors, wait for every core's Ready.
        ConfigError / EngineCoreError (naming the replica) when it cannot."""
        check_engine_config(config)
        threads = config.num_threads or 1
        loop = asyncio.get_running_loop()
        owns = await loop.run_in_executor(None, join_cluster, options.ray_address,
                                          options.size * threads)
        ray = import_ray()
        host = reachable_host(options.ray_address is None)
        actor = actor_class(ray, threads, options.max_restarts)
        config_json = config.model_copy(update={"num_threads": threads}).model_dump_json()
        replicas = [Replica(f"replica-{i}", actor.remote(config_json, f"replica-{i}"), host,
                            make_engine, options.max_restarts) for i in range(options.size)]
        replica_set = cls(replicas, Router(options.routing), owns)
        starts = [asyncio.ensure_future(r.start()) for r in replicas]
        try:
            await asyncio.gather(*starts)
            models = {(r.engine.info.vocab_size, r.engine.info.max_model_len,
                       tuple(r.engine.info.eos_token_ids)) for r in replicas if r.engine}
            if len(models) > 1:   # each replica validates against its own limits otherwise
                raise ConfigError(f"the replicas serve different models (vocabulary, "
                                  f"context length, EOS tokens): {sorted(models)}")
        except BaseException:
            for task in starts:
                task.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            await replica_set._close()
            raise
        return replica_set

    # ---- what the server reads ----------------------------------------------------------

    @property
    def _current(self) -> list[AsyncEngine]:
        return [r.engine for r in self.replicas if r.engine is not None]

    @property
    def info(self) -> Ready:
        return self._current[0].info

    @property
    def members(self) -> list[tuple[str, AsyncEngine]]:
        return [(r.name, r.engine) for r in self.replicas if r.engine is not None]

    @property
    def stats(self) -> CoreStats:
        return _sum_stats([e.stats for e in self._current])

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self._current)

    @property
    def detokenize_seconds(self) -> float:
        return sum(e.detokenize_seconds for e in self._current)

    @property
    def observer(self) -> EngineObserver | None:
        return self._observer

    @observer.setter
    def observer(self, observer: EngineObserver | None) -> None:
        self._observer = observer
        for e in self._current:
            e.observer = observer

    @property
    def in_rotation(self) -> list[Replica]:
        return [r for r in self.replicas if r.in_rotation and r.engine is not None
                and r.engine.is_alive]

    @property
    def is_alive(self) -> bool:
        return not self._stopping and any(not r.dead for r in self.replicas)

    @property
    def fatal_error(self) -> str | None:
        if any(not r.dead for r in self.replicas):
            return None
        return "every replica is dead: " + "; ".join(str(r.last_error) for r in self.replicas)

    @property
    def unresponsive_reason(self) -> str | None:
        """None while some replica in rotation reports in time."""
        live = self.in_rotation
        if any(r.engine.unresponsive_reason is None for r in live):
            return None
        if not live:
            return "no replica is in rotation (" + "; ".join(
                f"{r.name}: {'dead' if r.dead else 'restarting'}" for r in self.replicas) + ")"
        return "; ".join(f"{r.name}: {r.engine.unresponsive_reason}" for r in live)

    @property
    def last_heard(self) -> float:
        return max((e.last_heard for e in self._current), default=time.monotonic())

    @property
    def liveness(self) -> CoreLiveness:
        """The most recently heard replica's liveness."""
        return max((e.liveness for e in self._current), key=lambda lv: lv.last_heard,
                   default=CoreLiveness(LivenessConfig()))

    async def wait_dead(self) -> None:
        await self._dead.wait()

    # ---- requests -----------------------------------------------------------------------

    def route(self, prompt_token_ids: list[int], lora_int_id: int = 0
              ) -> tuple[Replica, list]:
        """The replica for a prompt and the prompt's block hashes (empty unless routing is
        prefix-aware)."""
        live = self.in_rotation
        if not live:
            if self.fatal_error is not None:
                raise EngineDeadError(self.fatal_error)
            raise EngineUnresponsiveError(f"{self.unresponsive_reason}; retry shortly")
        hashes = prompt_hashes(prompt_token_ids, self.info.block_size, None, lora_int_id) \
            if self.router.uses_prefixes else []
        choice = self.router.choose([Candidate(i, r.engine.num_open,
                                               r.index.match(hashes) if hashes else 0)
                                     for i, r in enumerate(live)])
        return live[choice.index], hashes

    def add_request_group(self, prompt_token_ids: list[int], params: SamplingParams, n: int,
                          request_id: str, stop: list[str] | None = None, priority: int = 0,
                          lora: tuple[str, int, str] | None = None) -> list[RequestStream]:
        replica, hashes = self.route(prompt_token_ids, 0 if lora is None else lora[1])
        streams = replica.engine.add_request_group(prompt_token_ids, params, n, request_id,
                                                   stop, priority, lora)
        if hashes:   # only an admitted request's prompt is noted as on its way there
            replica.index.note_routed(hashes)
        return streams

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                    stop: list[str] | None = None, priority: int = 0,
                    lora: tuple[str, int, str] | None = None) -> RequestStream:
        return self.add_request_group(prompt_token_ids, params, 1, request_id, stop, priority,
                                      lora)[0]

    def unload_adapter(self, lora_int_id: int) -> None:
        for e in self._current:
            e.unload_adapter(lora_int_id)

    # ---- lifecycle -----------------------------------------------------------------------

    def _replica_changed(self) -> None:
        for e in self._current:
            e.observer = self._observer
        if all(r.dead for r in self.replicas) and not self._stopping:
            self._dead.set()

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(r.supervise()) for r in self.replicas]

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(e.shutdown(drain_timeout_s) for e in self._current),
                             return_exceptions=True)
        await self._close()

    async def _close(self) -> None:
        """Stop every replica, kill its actor, leave Ray if this process started it."""
        for r in self.replicas:
            await r.stop()
        ray = import_ray()
        for r in self.replicas:
            try:
                ray.kill(r.actor, no_restart=True)
            except Exception:   # already gone
                pass
        if self._owns_ray:
            await asyncio.get_running_loop().run_in_executor(None, ray.shutdown)
