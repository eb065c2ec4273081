"""AsyncEngine: the engine core on its own thread, an asyncio front end that never blocks.

The event loop only validates, enqueues commands (add, abort) and awaits per-request streams.
The engine thread drains commands, runs `LLMEngine.step()`, turns new tokens into StreamDeltas
(detokenization and stop strings: OutputProcessor) and hands them to the loop with
`call_soon_threadsafe`. Orderings: a request's deltas arrive in generation order and its last
delta has `finished=True`; an abort (a cancelled or closed stream) frees the request's KV
blocks on the engine thread before the next step. Backpressure: at most `max_waiting`
requests may wait for a first schedule; beyond that `add_request` raises QueueFullError.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from tessellm.engine.llm_engine import LLMEngine, StepError
from tessellm.engine.output_processor import OutputProcessor, StreamDelta
from tessellm.errors import InvalidRequestError, TessellmError
from tessellm.request import FinishReason
from tessellm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(TessellmError, RuntimeError):
    """Too many requests are waiting; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineObserver(Protocol):
    """Receives engine-thread events (metrics). Calls must be cheap and never raise."""

    def on_step(self, engine: LLMEngine, num_scheduled: int, preempted: int) -> None: ...

    def on_first_scheduled(self, request_id: str, queue_time_s: float) -> None: ...


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: list[str] | None
    arrival: float


@dataclass(slots=True)
class _Abort:
    request_id: str


class RequestStream:
    """Async iterator over one request's StreamDeltas; closing it early aborts the request."""

    def __init__(self, request_id: str, engine: "AsyncEngine") -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamDelta:
        if self.finished:
            raise StopAsyncIteration
        try:
            delta = await self._queue.get()
        except asyncio.CancelledError:
            self.abort()
            raise
        if delta.finished:
            self.finished = True
        return delta

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    def _put(self, delta: StreamDelta) -> None:
        self._queue.put_nowait(delta)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256,
                 observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.observer = observer
        self._outputs = OutputProcessor(engine.parts.tokenizer)
        self._commands: deque[_Add | _Abort] = deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}
        self._arrivals: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="tessellm-engine", daemon=True)
        self.fatal_error: BaseException | None = None

    # ---- event-loop side ----------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs and has not died (the server's /health)."""
        return self._thread.is_alive() and self.fatal_error is None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._streams) - self.engine.scheduler.num_running)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                    stop: list[str] | None = None) -> RequestStream:
        """Validate and enqueue; raises InvalidRequestError or QueueFullError (nothing queued)."""
        if self._stopping or self.fatal_error is not None:
            raise QueueFullError("the engine is shutting down", retry_after_s=5)
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        self.engine.validate(prompt_token_ids, params)
        if self.num_waiting >= self.max_waiting:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (limit "
                                 f"{self.max_waiting}); retry later")
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self._send(_Add(request_id, list(prompt_token_ids), params, stop, time.monotonic()))
        return stream

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting; wait up to drain_timeout_s for in-flight requests, abort the rest."""
        self._stopping = True
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            self.abort(rid)
        self._wakeup.set()
        if self._thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def _deliver(self, delta: StreamDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return
        if delta.finished:
            del self._streams[delta.request_id]
        stream._put(delta)

    # ---- engine thread ------------------------------------------------------------------

    def _post(self, delta: StreamDelta) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._deliver, delta)

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            if command.request_id in self._outputs.tracked:
                self.engine.abort(command.request_id)
                self._emit(command.request_id)
            return
        try:
            request = self.engine.add_request(command.prompt_token_ids, command.params,
                                              request_id=command.request_id)
        except TessellmError as e:  # validated on the loop; a late refusal still answers
            self._post(StreamDelta(command.request_id, [], "", [], True, "error", str(e)))
            return
        if self.observer is not None:
            self._arrivals[command.request_id] = command.arrival
        self._outputs.track(request, command.stop)

    def _emit(self, request_id: str) -> None:
        delta, finish_now = self._outputs.collect(request_id)
        if delta is not None and delta.finished:
            self._arrivals.pop(request_id, None)  # never scheduled (aborted while waiting)
        if finish_now:
            self.engine.scheduler.finish_requests([request_id], FinishReason.STOP)
        if delta is not None:
            self._post(delta)

    def _note_first_schedules(self) -> None:
        if self.observer is None:
            return
        now = time.monotonic()
        for rid, t in self._outputs.tracked.items():
            if rid in self._arrivals and t.request.num_computed_tokens > 0:
                self.observer.on_first_scheduled(rid, now - self._arrivals.pop(rid))

    def _run(self) -> None:
        try:
            while True:
                while self._commands:
                    self._apply(self._commands.popleft())
                if not self.engine.has_unfinished():
                    if self._stopping and not self._commands:
                        return
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                try:
                    self.engine.step()
                except StepError as e:  # only that step's requests failed (finished: error)
                    log.error("%s", e)
                if self.observer is not None:
                    self.observer.on_step(self.engine, 0, 0)
                self._note_first_schedules()
                t0 = time.perf_counter()
                for rid in list(self._outputs.tracked):
                    self._emit(rid)
                self.engine.stage_times.add("detokenize", time.perf_counter() - t0)
        except BaseException as e:  # a bug in the engine loop: fail every request, loudly
            log.exception("engine thread died")
            self.fatal_error = e
            for rid in list(self._outputs.tracked):
                self._post(StreamDelta(rid, [], "", [], True, "error", f"engine failure: {e}"))
