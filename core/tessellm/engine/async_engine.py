"""AsyncEngine: the asyncio front end of one engine core (EngineCoreClient).

On the event loop it validates requests (RequestLimits, from the core's Ready: where a
request enters), sends adds and finishes to the core, and runs one output task that receives
the core's StepOutputs, detokenizes and applies stop strings (OutputProcessor) and feeds each
request's RequestStream. The step loop itself runs in the core (its own process in the server), so the
event loop never waits on a step and the two never share an interpreter lock.
Orderings: a request's deltas arrive in generation order and its last delta has
`finished=True`. Closing or cancelling a stream aborts its request (the core frees its blocks
before its next step). A stop string ends the stream at once; the core finishes the request
at its next step (a token computed meanwhile is discarded).
Admission (`add_request_group`) is one transaction, its steps in ADMISSION_STEPS order: a
request that fails any step leaves no trace (no stream, no output state, nothing counted as
queued, nothing sent to the core). Backpressure: at most `max_waiting` requests may wait for
a first schedule beyond the running batch's free seats; past that `add_request` raises
QueueFullError. Liveness (CoreLiveness): while the core is silent past the heartbeat timeout
new requests get EngineUnresponsiveError; past the stall timeout the requests in flight end
with an error too. When the core dies every open stream ends at once with an error,
`is_alive` turns False, `fatal_error` says why and new requests get EngineDeadError.
An engine that is one of several replicas (tessellm.ray) has a `name`, which every error it
fails a request with starts with, and may watch each StepOutputs (`on_outputs`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from tessellm.engine.core_client import EngineCoreClient, EngineCoreError
from tessellm.engine.core_liveness import CoreLiveness, LivenessConfig
from tessellm.engine.core_messages import (AddRequest, CoreFailed, CoreStats, FinishRequests,
                                           Heartbeat, StepOutputs, UnloadAdapter,
                                           params_to_wire)
from tessellm.engine.output_processor import OutputProcessor, StreamDelta
from tessellm.engine.request_limits import RequestLimits
from tessellm.errors import InvalidRequestError, TessellmError
from tessellm.request import sample_ids
from tessellm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(TessellmError, RuntimeError):
    """Too many requests are waiting; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(TessellmError, RuntimeError):
    """The engine core is dead or stopping: no request can be taken."""


class EngineUnresponsiveError(TessellmError, RuntimeError):
    """The engine core is alive but has not reported within the heartbeat timeout (or its
    current step has stalled): no request is taken until it does."""


# The steps of admission, in order (AsyncEngine.add_request_group); a test seam may fail any.
ADMISSION_STEPS = ("validate", "accept", "outputs", "encode", "register", "send")
AdmissionFault = Callable[[str], None]   # called with each step's name before it runs
LIVENESS_POLL_S = 0.25


class EngineObserver(Protocol):
    """Receives core events (metrics). Calls must be cheap and never raise."""

    def on_first_scheduled(self, request_id: str, queue_time_s: float) -> None: ...


class RequestStream:
    """Async iterator over one request's StreamDeltas; closing it early aborts the request."""

    def __init__(self, request_id: str, engine: "AsyncEngine", added_at: float = 0.0) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        self.finished = False
        self.added_at = added_at   # time.monotonic() when admitted (the core's arrival)
        self.queue_time_s: float | None = None   # arrival to first schedule, once reported

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
    def __init__(self, core: EngineCoreClient, tokenizer: object, max_waiting: int = 256,
                 observer: EngineObserver | None = None,
                 liveness: LivenessConfig = LivenessConfig(),
                 admission_fault: AdmissionFault | None = None, name: str = "",
                 on_outputs: Callable[[StepOutputs], None] | None = None) -> None:
        if core.ready is None:
            raise EngineDeadError("the engine core is not ready (await wait_ready() first)")
        self.core = core
        self.info = core.ready
        self.limits = RequestLimits(self.info.priority_levels, self.info.vocab_size,
                                    self.info.max_model_len, self.info.block_size,
                                    self.info.num_kv_blocks, self.info.prompt_logprobs,
                                    self.info.speculative_tokens,
                                    tuple(self.info.kv_windows), self.info.step_tokens)
        self.max_waiting = max_waiting
        self.observer = observer
        self.name = name
        self._on_outputs = on_outputs
        self.stats = CoreStats()
        self.detokenize_seconds = 0.0
        self.liveness = CoreLiveness(liveness)
        self.fatal_error: str | None = None
        self._outputs = OutputProcessor(tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._unscheduled: set[str] = set()   # admitted, not yet reported first scheduled
        self._admission_fault = admission_fault
        self._stall_reported = False
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self._dead = asyncio.Event()

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self.liveness.heard()
        self._tasks = [asyncio.ensure_future(self._receive()),
                       asyncio.ensure_future(self._watch()),
                       asyncio.ensure_future(self._watch_liveness())]

    @property
    def is_alive(self) -> bool:
        return self.fatal_error is None and self.core.alive

    @property
    def last_heard(self) -> float:
        """time.monotonic() of the core's latest message."""
        return self.liveness.last_heard

    @property
    def unresponsive_reason(self) -> str | None:
        """Why the (live) core counts as unresponsive now; None while it reports in time."""
        return self.liveness.unresponsive_reason()

    async def wait_dead(self) -> None:
        await self._dead.wait()

    @property
    def num_waiting(self) -> int:
        """Requests accepted and not yet running (as of the core's latest report)."""
        return max(0, len(self._streams) - self.stats.num_running)

    @property
    def num_open(self) -> int:
        """Requests admitted and not finished (running or waiting, as the front end knows)."""
        return len(self._streams)

    @property
    def members(self) -> list[tuple[str, AsyncEngine]]:
        """The engines behind this front end by name: this one ("" when it is the only one)."""
        return [(self.name, self)]

    @property
    def num_queued(self) -> int:
        """Requests admitted and never scheduled yet, less the seats the running batch had
        free at the core's latest report (a burst that fits the batch does not queue)."""
        free = max(0, self.info.max_num_seqs - self.stats.num_running)
        return max(0, len(self._unscheduled) - free)

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop accepting; wait up to drain_timeout_s for in-flight requests, abort the
        rest, then stop the core. A second call returns at once."""
        if self._stopping:
            return
        self._stopping = True
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and self.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            self.abort(rid)
        for task in self._tasks:
            task.cancel()
        self._fail_open("the server is shutting down", "abort")
        await asyncio.get_running_loop().run_in_executor(None, self.core.close)

    # ---- requests -----------------------------------------------------------------------

    def _check_accepting(self, n: int) -> None:
        if self.fatal_error is not None or not self.core.alive:
            raise EngineDeadError(f"the engine core is dead: {self.fatal_error or 'exited'}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        reason = self.unresponsive_reason
        if reason is not None:
            raise EngineUnresponsiveError(f"{reason}; not taking requests until it does")
        if n > self.max_waiting:
            raise InvalidRequestError(f"the request has {n} sequences; at most "
                                      f"{self.max_waiting} may wait at once here", "n")
        if self.num_queued + n > self.max_waiting:
            raise QueueFullError(f"{self.num_queued} requests are waiting (limit "
                                 f"{self.max_waiting}); retry later")

    def _fault(self, step: str) -> None:
        if self._admission_fault is not None:
            self._admission_fault(step)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                    stop: list[str] | None = None, priority: int = 0,
                    lora: tuple[str, int, str] | None = None) -> RequestStream:
        """Validate and send; raises InvalidRequestError, QueueFullError or EngineDeadError
        (nothing is queued then). `lora`: (name, int id, path) of a LoRA adapter."""
        return self.add_request_group(prompt_token_ids, params, 1, request_id, stop, priority,
                                      lora)[0]

    def add_request_group(self, prompt_token_ids: list[int], params: SamplingParams, n: int,
                          request_id: str, stop: list[str] | None = None,
                          priority: int = 0, lora: tuple[str, int, str] | None = None
                          ) -> list[RequestStream]:
        """n samples of one prompt sharing its KV blocks (the prompt is computed once); stream
        i carries sample_ids(request_id, n)[i] (seed + i when a seed is set). Raises like
        add_request; nothing is queued then.

        One transaction (ADMISSION_STEPS): validate, accept (queue and liveness), prepare the
        output state (detokenizer, stop strings), encode the message, register the streams,
        send. Only `register` changes this engine's state, and a failure of `send` undoes it."""
        self._fault("validate")
        self.limits.validate(prompt_token_ids, params, priority, n)
        ids = sample_ids(request_id, n)
        if any(rid in self._streams for rid in ids):
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        self._fault("accept")
        self._check_accepting(n)
        self._fault("outputs")
        outputs = [self._outputs.prepare(list(prompt_token_ids), stop) for _ in ids]
        self._fault("encode")
        arrival = time.monotonic()
        message = self.core.encode(AddRequest(request_id, list(prompt_token_ids),
                                              params_to_wire(params), priority, n, arrival,
                                              None if lora is None else list(lora)))
        streams = [RequestStream(rid, self, arrival) for rid in ids]
        try:
            self._fault("register")
            for rid, stream, output in zip(ids, streams, outputs):
                self._streams[rid] = stream
                self._outputs.tracked[rid] = output
                self._unscheduled.add(rid)
            self._fault("send")
            self.core.send(message)
        except BaseException:
            for rid in ids:
                self._forget(rid)
            raise
        return streams

    def _forget(self, request_id: str) -> None:
        """Drop everything the front end holds for a request."""
        self._streams.pop(request_id, None)
        self._outputs.tracked.pop(request_id, None)
        self._unscheduled.discard(request_id)

    def abort(self, request_id: str) -> None:
        self._send_finish([request_id], "abort")

    def unload_adapter(self, lora_int_id: int) -> None:
        """Tell the core to drop a LoRA adapter (its running requests keep it)."""
        if self.core.alive:
            try:
                self.core.send(UnloadAdapter(lora_int_id))
            except EngineCoreError:   # dying: nothing left to unload from
                pass

    def _send_finish(self, request_ids: list[str], reason: str) -> None:
        if self.core.alive:
            try:
                self.core.send(FinishRequests(request_ids, reason))
            except EngineCoreError:   # not connected: it is dying, and _watch fails them all
                pass

    # ---- outputs ------------------------------------------------------------------------

    def _deliver(self, delta: StreamDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return
        if delta.finished:
            self._forget(delta.request_id)
        stream._put(delta)

    def _handle(self, out: StepOutputs) -> None:
        self.stats = out.stats
        if self._on_outputs is not None:
            self._on_outputs(out)
        for rid, waited in out.first_scheduled:
            self._unscheduled.discard(rid)
            stream = self._streams.get(rid)
            if stream is not None:
                stream.queue_time_s = waited
            if self.observer is not None:
                self.observer.on_first_scheduled(rid, waited)
        t0 = time.perf_counter()
        stops = []
        for d in out.deltas:
            if d.request_id not in self._streams:
                continue
            delta, stop_now = self._outputs.process(d)
            if stop_now:
                stops.append(d.request_id)
            if delta is not None:
                self._deliver(delta)
        if stops:
            self._send_finish(stops, "stop")
        self.detokenize_seconds += time.perf_counter() - t0

    async def _receive(self) -> None:
        try:
            while True:
                message = await self.core.recv()
                if isinstance(message, Heartbeat):
                    self.liveness.heard(message.step_age_s)
                    continue
                self.liveness.heard()
                if isinstance(message, StepOutputs):
                    self._handle(message)
                elif isinstance(message, CoreFailed):
                    self._die(message.error)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken message or socket: the core is unusable
            log.exception("engine core output path failed")
            self._die(f"engine core output path failed: {type(e).__name__}: {e}")

    async def _watch(self) -> None:
        await self.core.wait_dead()
        if not self._stopping:
            self._die("the engine core process exited unexpectedly")

    async def _watch_liveness(self) -> None:
        """Log the core turning unresponsive and back; fail the requests in flight once it
        has stalled (their aborts are queued for the core, should it come back)."""
        was_unresponsive = False
        while True:
            await asyncio.sleep(LIVENESS_POLL_S)
            reason = self.unresponsive_reason
            if reason is not None and not was_unresponsive:
                log.warning("engine core unresponsive: %s", reason)
            elif reason is None and was_unresponsive:
                log.warning("engine core responsive again")
                self._stall_reported = False
            was_unresponsive = reason is not None
            stalled = self.liveness.stalled_reason()
            if stalled is not None and self._streams:
                if not self._stall_reported:
                    log.error("engine core stalled (%s): failing %d request(s) in flight",
                              stalled, len(self._streams))
                    self._stall_reported = True
                ids = list(self._streams)
                self._fail_open(self._named(f"engine core stalled: {stalled}"))
                self._send_finish(ids, "abort")

    def _named(self, error: str) -> str:
        return f"{self.name}: {error}" if self.name else error

    def _die(self, error: str) -> None:
        error = self._named(error)
        if self.fatal_error is None:
            self.fatal_error = error
            log.error("engine core dead: %s", error)
        self._fail_open(f"engine failure: {error}")
        self._dead.set()

    def _fail_open(self, error: str, reason: str = "error") -> None:
        """End every open stream now (each exactly once): `reason` "error" when the core
        died, "abort" when the server stops."""
        for rid in list(self._streams):
            self._deliver(StreamDelta(rid, [], "", [], True, reason, error))
