"""EngineCoreClient: the front end's handle on one engine core, over two zmq sockets.

`spawn(config)` starts the core in a process of its own (multiprocessing "spawn": a fresh
interpreter that imports torch itself, so nothing of the front end's state is forked into
it) connected through ipc:// sockets in a private temporary directory; `in_thread(engine)`
runs the same loop on a thread over inproc:// sockets (tests, embedding); `remote(host, start)`
binds tcp:// sockets on `host` for a core that another launcher starts elsewhere (a Ray
actor: tessellm.ray), connecting back to them. Either way a core
that fails to start sends StartupFailed with the reason, which `wait_ready` raises as
EngineCoreError. Messages are msgspec structs (tessellm.engine.core_messages), never pickles.

Liveness: `alive` is the process (or thread) running; `wait_dead()` returns when it is not,
so the async front end can fail every open stream at once instead of waiting on a socket.
Sending never blocks the caller's event loop: the socket to the core queues without a limit
(a frozen core is detected by its silence, CoreLiveness, and new requests are then refused),
and a core that is not connected at all makes `send` raise EngineCoreError.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from tessellm.config import EngineConfig
from tessellm.engine.core_messages import (Codec, CoreFailed, FromCore, Ready, Shutdown,
                                           StartupFailed, ToCore)
from tessellm.errors import TessellmError

CoreEntry = Callable[[str, str, str, int], None]   # the core process's target (see spawn)
# a remote core's launcher (see remote): given the addresses to connect to, it starts the
# core and returns (is_alive, stop(timeout_s)) for it
RemoteStart = Callable[[str, str], tuple[Callable[[], bool], Callable[[float], None]]]


class EngineCoreError(TessellmError, RuntimeError):
    """The engine core could not start, or died."""


class EngineCoreClient:
    def __init__(self, ctx: zmq.Context, to_core: zmq.Socket, from_core: zmq.asyncio.Socket,
                 is_alive: Any, pid: int, stop: Any, tmpdir: str | None = None) -> None:
        self._ctx, self._to_core, self._from_core = ctx, to_core, from_core
        self._is_alive, self._stop, self._tmpdir = is_alive, stop, tmpdir
        self.pid = pid
        self._encode, self._decode = Codec(None), Codec(FromCore)
        self.ready: Ready | None = None
        self.ipc_seconds = 0.0   # cumulative send -> receipt latency of the core's messages

    # ---- construction -----------------------------------------------------------------

    @staticmethod
    def _sockets(ctx: zmq.Context, to_addr: str, from_addr: str
                 ) -> tuple[zmq.Socket, zmq.asyncio.Socket]:
        to_core = ctx.socket(zmq.PUSH)
        to_core.setsockopt(zmq.LINGER, 0)
        to_core.setsockopt(zmq.SNDHWM, 0)   # never mute: a send queues, it does not block
        to_core.bind(to_addr)
        from_core = zmq.asyncio.Context.shadow(ctx).socket(zmq.PULL)
        from_core.setsockopt(zmq.LINGER, 0)
        from_core.bind(from_addr)
        return to_core, from_core

    @classmethod
    def spawn(cls, config: EngineConfig, entry: CoreEntry | None = None) -> EngineCoreClient:
        """Start a core process for `config` (it loads the model and profiles; call
        `await wait_ready()` next). `entry` is the process's target, called with
        (config JSON, inbox address, outbox address, parent pid): by default
        `core_entry.core_entry`; another must be picklable by reference and end by calling
        `engine_core.core_process_main` with those arguments."""
        if entry is None:
            from tessellm.engine.core_entry import core_entry as entry
        tmpdir = tempfile.mkdtemp(prefix="tessellm-core-")
        to_addr, from_addr = f"ipc://{tmpdir}/to-core", f"ipc://{tmpdir}/from-core"
        ctx = zmq.Context()
        to_core, from_core = cls._sockets(ctx, to_addr, from_addr)
        proc = multiprocessing.get_context("spawn").Process(
            target=entry, name="tessellm-engine-core", daemon=True,
            args=(config.model_dump_json(), to_addr, from_addr, os.getpid()))
        proc.start()

        def stop(timeout: float) -> None:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

        return cls(ctx, to_core, from_core, proc.is_alive, proc.pid, stop, tmpdir)

    @classmethod
    def remote(cls, host: str, start: RemoteStart) -> EngineCoreClient:
        """Bind both sockets on free tcp ports of `host` (an address the core's machine can
        reach) and call `start` with their addresses; the core it starts connects to them
        and runs `engine_core.run_core`. `pid` is the core's once Ready names it."""
        ctx = zmq.Context()
        to_core, from_core = cls._sockets(ctx, f"tcp://{host}:*", f"tcp://{host}:*")
        try:
            is_alive, stop = start(to_core.getsockopt(zmq.LAST_ENDPOINT).decode(),
                                   from_core.getsockopt(zmq.LAST_ENDPOINT).decode())
        except BaseException:
            to_core.close(0)
            from_core.close(0)
            ctx.term()
            raise
        return cls(ctx, to_core, from_core, is_alive, 0, stop)

    @classmethod
    def in_thread(cls, engine: Any) -> EngineCoreClient:
        """Run the core loop over an already built LLMEngine on a thread of this process."""
        from tessellm.engine.engine_core import EngineCoreLoop, ready_message
        from tessellm.engine.kernel_warmup import prepare_kernels
        ctx = zmq.Context()
        tag = f"{id(engine)}-{time.monotonic_ns()}"
        to_addr, from_addr = f"inproc://to-core-{tag}", f"inproc://from-core-{tag}"
        to_core, from_core = cls._sockets(ctx, to_addr, from_addr)
        inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        inbox.connect(to_addr)
        outbox.connect(from_addr)

        def run() -> None:
            loop = EngineCoreLoop(engine, inbox, outbox)
            try:
                try:
                    ready = ready_message(engine, prepare_kernels(engine))
                except BaseException as e:   # wait_ready raises with this reason
                    loop.send(StartupFailed(f"{type(e).__name__}: {e}"))
                    return
                loop.send(ready)
                loop.run()
            except BaseException:
                pass  # the loop logged it and sent CoreFailed; the thread's end shows the death
            finally:
                inbox.close(0)
                outbox.close(linger=1000)

        thread = threading.Thread(target=run, name="tessellm-engine-core", daemon=True)
        thread.start()
        return cls(ctx, to_core, from_core, thread.is_alive, os.getpid(), thread.join)

    # ---- use --------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self._is_alive())

    def encode(self, message: ToCore) -> bytes:
        """The wire form of a message (raises for values msgpack cannot carry, e.g. integers
        beyond 64 bits: nothing was sent then)."""
        return self._encode.encode(message)

    def send(self, message: ToCore | bytes) -> None:
        """Queue a message (or its `encode`d bytes) for the core; never blocks. Raises
        EngineCoreError when no core is connected to take it."""
        data = message if isinstance(message, bytes) else self.encode(message)
        try:
            self._to_core.send(data, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineCoreError("the engine core is not connected") from None

    async def recv(self) -> FromCore:
        data = await self._from_core.recv(copy=False)
        message = self._decode.decode(data)
        sent_at = getattr(message, "sent_at", None)
        if sent_at is not None:
            self.ipc_seconds += max(0.0, time.time() - sent_at)
        return message

    async def wait_dead(self, poll_s: float = 0.05) -> None:
        while self.alive:
            await asyncio.sleep(poll_s)

    async def wait_ready(self) -> Ready:
        """The core's Ready; EngineCoreError if it fails to start or dies first."""
        death = asyncio.ensure_future(self.wait_dead())
        try:
            while True:
                receive = asyncio.ensure_future(self.recv())
                done, _ = await asyncio.wait({receive, death},
                                             return_when=asyncio.FIRST_COMPLETED)
                if receive not in done:
                    receive.cancel()
                    raise EngineCoreError("the engine core exited while starting (see its "
                                          "log above)")
                message = receive.result()
                if isinstance(message, Ready):
                    self.ready = message
                    self.pid = self.pid or message.pid
                    return message
                if isinstance(message, (StartupFailed, CoreFailed)):
                    raise EngineCoreError(f"the engine core failed to start: {message.error}")
        finally:
            death.cancel()

    def close(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait for it (kill it past `timeout`), release the sockets."""
        if self.alive:
            try:
                self.send(Shutdown())
            except (zmq.ZMQError, EngineCoreError):
                pass
        self._stop(timeout)
        self._to_core.close(0)
        self._from_core.close(0)
        self._ctx.term()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
