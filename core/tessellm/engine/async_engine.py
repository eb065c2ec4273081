"""AsyncEngine: the engine core on its own thread, an asyncio front end that never blocks.

Three stages, pipelined:
  event loop     validates, enqueues commands (add, abort) and awaits per-request streams;
  engine thread  drains commands, runs `LLMEngine.step()`, and hands each request's new tokens
                 (RawDelta) to the output thread — then goes straight on to the next step;
  output thread  detokenizes and applies stop strings (OutputProcessor) for step N while the
                 engine computes step N+1 (torch releases the GIL in its kernels), and posts
                 StreamDeltas to the loop with `call_soon_threadsafe`.
Orderings: a request's deltas arrive in generation order and its last delta has
`finished=True`. An abort (a cancelled or closed stream) frees the request's KV blocks on the
engine thread before its next step. A stop string finishes the stream at once; the engine
stops the request at its next step (a token computed meanwhile is discarded). Backpressure: at
most `max_waiting` requests may wait for a first schedule; beyond that `add_request` raises
QueueFullError.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from tessellm.engine.llm_engine import LLMEngine, StepError
from tessellm.engine.output_processor import OutputProcessor, RawDelta, StreamDelta
from tessellm.errors import InvalidRequestError, TessellmError
from tessellm.request import FinishReason, Request
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
    priority: int = 0
    n: int = 1  # n > 1: copy-on-write siblings "<request_id>-<i>" (LLMEngine.add_request_group)


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _StopString:
    """The output thread saw a stop string: the engine finishes the request (reason stop)."""

    request_id: str


@dataclass(slots=True)
class _Track:
    """Tells the output thread about a new request (ahead of its first RawDelta)."""

    request_id: str
    prompt_token_ids: list[int]
    stop: list[str] | None


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
        self._output_queue: queue.SimpleQueue[_Track | list[RawDelta] | None] = queue.SimpleQueue()
        self._tracked: dict[str, tuple[Request, int]] = {}  # engine thread: request, sent
        self._commands: deque[_Add | _Abort | _StopString] = deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}
        self._arrivals: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="tessellm-engine", daemon=True)
        self._output_thread = threading.Thread(target=self._run_outputs,
                                               name="tessellm-outputs", daemon=True)
        self.fatal_error: BaseException | None = None

    # ---- event-loop side ----------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()
        self._output_thread.start()

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
                    stop: list[str] | None = None, priority: int = 0) -> RequestStream:
        """Validate and enqueue; raises InvalidRequestError or QueueFullError (nothing queued)."""
        if self._stopping or self.fatal_error is not None:
            raise QueueFullError("the engine is shutting down", retry_after_s=5)
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        self.engine.validate(prompt_token_ids, params, priority)
        if self.num_waiting >= self.max_waiting:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (limit "
                                 f"{self.max_waiting}); retry later")
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self._send(_Add(request_id, list(prompt_token_ids), params, stop, time.monotonic(),
                        priority))
        return stream

    def add_request_group(self, prompt_token_ids: list[int], params: SamplingParams, n: int,
                          request_id: str, stop: list[str] | None = None,
                          priority: int = 0) -> list[RequestStream]:
        """n samples of one prompt sharing its KV blocks (the prompt is computed once); stream
        i carries sample "<request_id>-<i>" (seed + i when a seed is set). n == 1 is
        add_request. Raises like add_request; nothing is queued then."""
        if n == 1:
            return [self.add_request(prompt_token_ids, params, request_id, stop, priority)]
        ids = [f"{request_id}-{i}" for i in range(n)]
        if self._stopping or self.fatal_error is not None:
            raise QueueFullError("the engine is shutting down", retry_after_s=5)
        if any(rid in self._streams for rid in ids):
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {n!r}", "n")
        self.engine.validate(prompt_token_ids, params, priority)
        if self.num_waiting + n > self.max_waiting:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (limit "
                                 f"{self.max_waiting}); retry later")
        streams = [RequestStream(rid, self) for rid in ids]
        self._streams.update(zip(ids, streams))
        self._send(_Add(request_id, list(prompt_token_ids), params, stop, time.monotonic(),
                        priority, n))
        return streams

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
        loop = asyncio.get_running_loop()
        for thread in (self._thread, self._output_thread):
            if thread.is_alive():
                await loop.run_in_executor(None, thread.join)

    def _send(self, command: _Add | _Abort | _StopString) -> None:
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

    def _apply(self, command: _Add | _Abort | _StopString) -> None:
        if isinstance(command, (_Abort, _StopString)):
            if command.request_id in self._tracked:
                reason = FinishReason.ABORT if isinstance(command, _Abort) else FinishReason.STOP
                self.engine.scheduler.finish_requests([command.request_id], reason)
            return
        try:
            requests = self.engine.add_request_group(
                command.prompt_token_ids, command.params, command.n,
                request_id=command.request_id, priority=command.priority)
        except TessellmError as e:  # validated on the loop; a late refusal still answers
            ids = [command.request_id] if command.n == 1 else \
                [f"{command.request_id}-{i}" for i in range(command.n)]
            for rid in ids:
                self._post(StreamDelta(rid, [], "", [], True, "error", str(e)))
            return
        for request in requests:
            rid = request.request_id
            if self.observer is not None:
                self._arrivals[rid] = command.arrival
            self._tracked[rid] = (request, 0)
            self._output_queue.put(_Track(rid, request.prompt_token_ids, command.stop))

    def _raw_deltas(self) -> list[RawDelta]:
        """New tokens and finish states of every tracked request since the last call."""
        deltas = []
        for rid, (r, sent) in list(self._tracked.items()):
            n = len(r.output_token_ids)
            if n == sent and not r.is_finished:
                continue
            reason = r.finish_reason.value if r.is_finished and r.finish_reason else None
            deltas.append(RawDelta(
                rid, r.output_token_ids[sent:n], r.output_logprobs[sent:n], r.is_finished,
                reason, "engine step failed" if r.finish_reason is FinishReason.ERROR else None,
                r.num_prompt_tokens, n))
            if r.is_finished:
                del self._tracked[rid]
                self._arrivals.pop(rid, None)  # never scheduled (aborted while waiting)
            else:
                self._tracked[rid] = (r, n)
        return deltas

    def _note_first_schedules(self) -> None:
        if self.observer is None:
            return
        now = time.monotonic()
        for rid, (r, _) in self._tracked.items():
            if rid in self._arrivals and r.num_computed_tokens > 0:
                self.observer.on_first_scheduled(rid, now - self._arrivals.pop(rid))

    def _run(self) -> None:
        try:
            while True:
                while self._commands:
                    self._apply(self._commands.popleft())
                deltas = self._raw_deltas()  # aborts applied just now
                if deltas:
                    self._output_queue.put(deltas)
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
                self._output_queue.put(self._raw_deltas())
        except BaseException as e:  # a bug in the engine loop: fail every request, loudly
            log.exception("engine thread died")
            self.fatal_error = e
            self._output_queue.put([
                RawDelta(rid, [], [], True, "error", f"engine failure: {e}", r.num_prompt_tokens,
                         len(r.output_token_ids)) for rid, (r, _) in self._tracked.items()])
        finally:
            self._output_queue.put(None)

    # ---- output thread ------------------------------------------------------------------

    def _run_outputs(self) -> None:
        while (item := self._output_queue.get()) is not None:
            if isinstance(item, _Track):
                self._outputs.track(item.request_id, item.prompt_token_ids, item.stop)
                continue
            t0 = time.perf_counter()
            for raw in item:
                delta, stop_now = self._outputs.process(raw)
                if stop_now:
                    self._send(_StopString(raw.request_id))
                if delta is not None:
                    self._post(delta)
            self.engine.stage_times.add("detokenize", time.perf_counter() - t0)
