"""Replica: one engine-core actor as the front end sees it, across its incarnations.

An incarnation: the front end binds fresh tcp sockets (EngineCoreClient.remote), calls the
actor's `run` with their addresses, waits for Ready and wraps the client in an AsyncEngine
named after the replica (its errors say which replica failed). States:

    starting -> in rotation -> (the actor's process dies, or its core fails) -> restarting
             -> in rotation (Ray restarted the actor and its core reported Ready) ...
             -> dead (more than max_restarts deaths, or the actor is gone for good)

Only a replica in rotation gets new requests. When an incarnation dies its AsyncEngine fails
its open streams at once (error "<name>: ..."), the replica leaves rotation, its PrefixIndex
is cleared, and `run` is called again: Ray queues the call while it restarts the actor. The
first incarnation's failure is the caller's error (start-up); later ones are retried until
the restarts are spent.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from tessellm.engine.async_engine import AsyncEngine
from tessellm.engine.core_client import EngineCoreClient, EngineCoreError
from tessellm.engine.core_messages import StepOutputs
from tessellm.ray.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

EngineFactory = Callable[[EngineCoreClient, str, Callable[[StepOutputs], None]], AsyncEngine]


class Replica:
    def __init__(self, name: str, actor: Any, host: str, make_engine: EngineFactory,
                 max_restarts: int) -> None:
        self.name, self.actor, self.host = name, actor, host
        self._make_engine = make_engine
        self.max_restarts = max_restarts
        self.index = PrefixIndex()
        self.engine: AsyncEngine | None = None   # the latest incarnation's (kept once dead)
        self.in_rotation = False
        self.restarts = 0                        # incarnations that died
        self.last_error: str | None = None
        self.dead = False                        # out for good
        self.changed: Callable[[], None] = lambda: None   # the set's hook: rotation changed

    # ---- one incarnation -------------------------------------------------------------

    def _start_core(self, inbox: str, outbox: str
                    ) -> tuple[Callable[[], bool], Callable[[float], None]]:
        future: concurrent.futures.Future = self.actor.run.remote(inbox, outbox).future()

        def stop(timeout_s: float) -> None:   # after Shutdown: the run call returns
            concurrent.futures.wait([future], timeout_s)

        return (lambda: not future.done()), stop

    def _on_outputs(self, out: StepOutputs) -> None:
        if out.stored_blocks or out.removed_blocks:
            self.index.apply(out.stored_blocks, out.removed_blocks)

    async def _incarnate(self) -> AsyncEngine:
        loop = asyncio.get_running_loop()
        client = await loop.run_in_executor(None, EngineCoreClient.remote, self.host,
                                            self._start_core)
        try:
            await client.wait_ready()
        except BaseException:
            await loop.run_in_executor(None, client.close, 1.0)
            raise
        self.index.clear()
        engine = self._make_engine(client, self.name, self._on_outputs)
        engine.start()
        return engine

    # ---- life ----------------------------------------------------------------------------

    async def start(self) -> None:
        """The first incarnation; EngineCoreError (named) when it fails to start."""
        try:
            self.engine = await self._incarnate()
        except EngineCoreError as e:
            raise EngineCoreError(f"{self.name}: {e}") from None
        self.in_rotation = True

    async def supervise(self) -> None:
        """Until stopped: on each death leave rotation, then bring the next incarnation in."""
        while not self.dead:
            assert self.engine is not None
            await self.engine.wait_dead()
            self.in_rotation = False
            self.last_error = self.engine.fatal_error
            self.changed()
            log.error("%s left rotation: %s", self.name, self.last_error)
            await self.engine.shutdown(0.0)
            while True:
                self.restarts += 1
                if self.restarts > self.max_restarts:
                    self.dead = True
                    log.error("%s is dead for good: %d deaths (max restarts %d)", self.name,
                              self.restarts, self.max_restarts)
                    self.changed()
                    return
                try:
                    self.engine = await self._incarnate()
                    break
                except EngineCoreError as e:
                    self.last_error = f"{self.name}: {e}"
                    log.error("%s failed to restart: %s", self.name, e)
                    await asyncio.sleep(1.0)
            self.in_rotation = True
            self.changed()
            log.warning("%s rejoined rotation (restart %d)", self.name, self.restarts)

    async def stop(self) -> None:
        self.in_rotation = False
        self.dead = True
        if self.engine is not None:
            await self.engine.shutdown(0.0)
