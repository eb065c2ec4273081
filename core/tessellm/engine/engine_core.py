"""The engine core: scheduler, KV manager, model runner and sampler behind two zmq sockets.

It runs in a process of its own (EngineCoreClient.spawn; the process's entry calls
`core_process_main`; it owns the device and torch's OpenMP threads, so the front end's event
loop never shares an interpreter lock with the step loop) or, for tests and embedding, on a
thread (`EngineCoreLoop` over inproc sockets). The loop: drain every message that arrived (adds, finishes, shutdown), run one
step if anything is unfinished, send the new tokens of every request (StepOutputs); while idle
it sends a StepOutputs heartbeat every HEARTBEAT_S. While one step runs longer than that, a
heartbeat thread sends Heartbeat(step age) instead. So the front end hears from a live core at
least every HEARTBEAT_S: silence means the process is frozen (stopped, swapped out, its
interpreter lock held), and a growing step age means the step loop is stuck.
Orderings: a request's deltas are sent in generation order and its last has finished=True;
a FinishRequests frees the blocks before the next step. A failing step fails only its requests
(their deltas say so, naming how many failed with them); a bug in the loop sends CoreFailed and
ends every open request with an error. With `publish_blocks` every StepOutputs also carries
the prefix cache's block hashes stored and evicted since the previous one (the first carries
the whole set), so a front end routing over replicas (tessellm.ray) mirrors each cache.
"""
from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import zmq

from tessellm.engine.core_messages import (AddRequest, Codec, CoreFailed, CoreStats,
                                           FinishRequests, Heartbeat, Ready, Shutdown,
                                           StartupFailed, StepOutputs, TokenDelta, ToCore,
                                           UnloadAdapter, params_from_wire)
from tessellm.engine.delta_tracker import DeltaTracker
from tessellm.engine.kernel_warmup import prepare_kernels
from tessellm.engine.startup_progress import StartupProgress
from tessellm.engine.llm_engine import LLMEngine, StepError
from tessellm.errors import TessellmError
from tessellm.lora.request import LoRARequest
from tessellm.plugin_spec import ENTRY_POINT_GROUP
from tessellm.request import FinishReason, sample_ids

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.25


def core_stats(engine: LLMEngine) -> CoreStats:
    s, prefix = engine.stats, engine.scheduler.prefix_cache_stats
    running, waiting = engine.scheduler.num_by_priority()
    return CoreStats(
        num_running=engine.scheduler.num_running, num_waiting=engine.scheduler.num_waiting,
        kv_usage=engine.kv.usage, num_steps=s.num_steps, num_preemptions=s.num_preemptions,
        num_prompt_tokens=s.num_prompt_tokens, num_generated_tokens=s.num_generated_tokens,
        prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
        host_syncs=engine.runner.host_syncs,
        stage_seconds=dict(engine.stage_times.snapshot()),
        device_counters=engine.parts.device.runtime_counters(),
        running_by_priority=running, waiting_by_priority=waiting,
        num_overlapped_steps=s.num_overlapped_steps, **spec_fields(engine),
        lora_counts={} if engine.lora is None else {
            name: [c.requests, c.prompt_tokens, c.generated_tokens]
            for name, c in engine.lora.counts.items()})


def spec_fields(engine: LLMEngine) -> dict:
    """CoreStats' speculation counters (none when the engine does not speculate)."""
    return {} if engine.speculator is None else engine.speculator.stats.to_wire()


def device_plugin_of(device: object) -> tuple[str, str]:
    """(entry-point name, distribution version) of the plugin whose package defines the
    device's class; ("", "") when no `tessellm.plugins` entry point lives in that package."""
    package = type(device).__module__.partition(".")[0]
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.value.partition(":")[0].partition(".")[0] == package:
            return ep.name, ep.dist.version if ep.dist is not None else ""
    return "", ""


def ready_message(engine: LLMEngine, kernel_choices: dict[str, str]) -> Ready:
    p, c = engine.parts, engine.parts.config
    plugin, plugin_version = device_plugin_of(p.device)
    return Ready(pid=os.getpid(), device=p.device.name,
                 dtype=str(p.dtype).removeprefix("torch."), max_model_len=engine.max_model_len,
                 vocab_size=p.spec.vocab_size, priority_levels=c.priority_levels,
                 block_size=c.block_size, num_kv_blocks=engine.kv.num_blocks,
                 weight_bytes=p.weight_bytes, eos_token_ids=sorted(p.eos_token_ids),
                 kernel_choices=kernel_choices, plugin=plugin, plugin_version=plugin_version,
                 max_num_seqs=c.max_num_seqs,
                 prompt_logprobs=engine.limits.prompt_logprobs,
                 speculative_tokens=engine.limits.speculative_tokens,
                 max_loras=c.max_loras if c.enable_lora else 0,
                 kv_windows=engine.limits.kv_windows,
                 step_tokens=engine.limits.step_tokens,
                 max_lora_rank=c.max_lora_rank if c.enable_lora else 0)


class EngineCoreLoop:
    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket,
                 parent_pid: int | None = None, publish_blocks: bool = False) -> None:
        self.engine = engine
        self._blocks = engine.kv.pool.cached_blocks if publish_blocks else None
        self._unpublished = [] if self._blocks is None else self._blocks.record_changes()
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.tracker = DeltaTracker()
        self._to_core, self._from_core = Codec(ToCore), Codec(None)
        self._stopping = False
        self._last_sent = 0.0
        self._send_lock = threading.Lock()   # the loop and the heartbeat thread share outbox
        self._step_started: float | None = None   # monotonic start of the running step

    def _outputs(self, deltas: list[TokenDelta], first_scheduled: list[tuple[str, float]]
                 ) -> StepOutputs:
        out = StepOutputs(deltas, core_stats(self.engine), first_scheduled, time.time())
        if self._blocks is not None:
            out.stored_blocks, out.removed_blocks = self._blocks.take_changes()
            if self._unpublished:
                out.stored_blocks = self._unpublished + out.stored_blocks
                self._unpublished = []
        return out

    def send(self, message: Any) -> None:
        with self._send_lock:
            self.outbox.send(self._from_core.encode(message), copy=False)
            self._last_sent = time.monotonic()

    def _heartbeats(self, stop: threading.Event) -> None:
        """While a step runs and the loop has sent nothing for HEARTBEAT_S, tell the front end
        the process lives and how long that step has run (outside steps the loop itself
        reports at least every HEARTBEAT_S)."""
        while not stop.wait(HEARTBEAT_S / 2):
            now, started = time.monotonic(), self._step_started
            if started is not None and now - self._last_sent >= HEARTBEAT_S:
                self.send(Heartbeat(now - started, time.time()))

    def _apply(self, message: Any) -> None:
        if isinstance(message, Shutdown):
            self._stopping = True
        elif isinstance(message, FinishRequests):
            reason = FinishReason.STOP if message.reason == "stop" else FinishReason.ABORT
            known = [rid for rid in message.request_ids if rid in self.tracker.sent]
            self.engine.finish_requests(known, reason)
        elif isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, UnloadAdapter) and self.engine.lora is not None:
            self.engine.lora.unload(message.lora_int_id)

    def _add(self, m: AddRequest) -> None:
        try:
            # validated where it entered (the front end's RequestLimits); its constraint is
            # compiled here, where the tokenizer is
            lora = None if m.lora is None else LoRARequest(*m.lora)
            requests = self.engine.queue_request_group(
                m.prompt_token_ids, params_from_wire(m.params), m.n, request_id=m.request_id,
                priority=m.priority, lora_request=lora)
        except (TessellmError, TypeError, ValueError) as e:
            ids = sample_ids(m.request_id, m.n)
            reason = "rejected" if isinstance(e, TessellmError) else "error"
            self.send(self._outputs([TokenDelta.final(rid, reason, str(e)) for rid in ids], []))
            return
        for r in requests:
            self.tracker.track(r, m.arrival)

    def _drain(self, timeout_ms: int) -> None:
        if not self.inbox.poll(timeout_ms):
            return
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._apply(self._to_core.decode(data))

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            self.engine.step()
        except StepError as e:  # only that step's requests failed (finished: error)
            log.error("%s", e)
            ids = [r.request_id for r in e.failed]
            note = (f"{e} (failed together in that step: {', '.join(ids[:8])}"
                    f"{' ...' if len(ids) > 8 else ''})")
            for rid in ids:
                self.tracker.step_errors[rid] = note
        finally:
            self._step_started = None

    def run(self) -> None:
        stop_heartbeats = threading.Event()
        heartbeats = threading.Thread(target=self._heartbeats, args=(stop_heartbeats,),
                                      daemon=True, name="tessellm-core-heartbeat")
        heartbeats.start()
        try:
            stages = self.engine.stage_times
            while True:
                busy = self.engine.has_unfinished()
                t0 = time.perf_counter()
                self._drain(0 if busy else int(HEARTBEAT_S * 1000))
                if busy:   # an idle wait for messages is not loop overhead
                    stages.add("core_messages", time.perf_counter() - t0)
                if self._stopping and not self.engine.has_unfinished():
                    return
                self.engine.check_alive()   # a lost tensor-parallel rank ends the core
                if self.engine.has_unfinished():
                    self._step()
                t0 = time.perf_counter()
                deltas = self.tracker.deltas()
                if deltas or time.monotonic() - self._last_sent >= HEARTBEAT_S:
                    self.send(self._outputs(deltas, self.tracker.first_scheduled()))
                stages.add("core_messages", time.perf_counter() - t0)
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    log.error("engine core: the front end (pid %d) is gone; exiting",
                              self.parent_pid)
                    return
        except BaseException as e:  # a bug in the loop: fail every request, loudly
            log.exception("engine core loop died")
            error = f"engine core failure: {type(e).__name__}: {e}"
            try:   # CoreFailed first: the front end marks the core dead and fails every
                # open stream in one go, so no client sees its stream fail while /health still
                # answers 200 (with the failed outputs first, a client's /health raced the
                # second message); the outputs follow for a reader that keeps reading
                self.send(CoreFailed(error))
                self.send(self._outputs(self.tracker.fail_all(error), []))
            except Exception:  # the socket may be what failed; the process exit still shows
                pass
            raise
        finally:   # before the caller closes the socket the heartbeats use
            stop_heartbeats.set()
            heartbeats.join(2 * HEARTBEAT_S)


def core_process_main(config_json: str, inbox_addr: str, outbox_addr: str,
                      parent_pid: int) -> None:
    """The spawned engine-core process's main, called by its entry (core_entry.core_entry by
    default) with plain strings and the parent's pid, so nothing else is pickled: run_core,
    exiting 1 when the core failed to start or its loop died."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s[core]: %(message)s")
    if run_core(config_json, inbox_addr, outbox_addr, parent_pid) is not None:
        sys.exit(1)


def run_core(config_json: str, inbox_addr: str, outbox_addr: str, parent_pid: int | None,
             publish_blocks: bool = False) -> str | None:
    """Connect to the front end's sockets, build the engine and choose kernels, send Ready (or
    StartupFailed), run the loop until Shutdown, then stop the engine's group. Returns None
    after a Shutdown, else why the core ended (it failed to start, or its loop died; the front
    end was told). `parent_pid`: the front end's pid when it is this machine's parent process
    (the core exits when it disappears); None for a core another launcher watches (Ray)."""
    from tessellm.config import EngineConfig
    from tessellm.engine.builder import build_engine_parts
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock, addr in ((inbox, inbox_addr), (outbox, outbox_addr)):
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(addr)
    codec = Codec(None)
    progress = StartupProgress(origin_pid=parent_pid)   # one timeline with the server's
    try:
        config = EngineConfig(**json.loads(config_json))
        progress.stage(f"engine core: loading {config.model}")
        engine = LLMEngine(build_engine_parts(config, core_tokenizer=True))
        ready = ready_message(engine, prepare_kernels(engine, progress))
        progress.stage(f"engine core: ready ({engine.parts.weight_bytes / 2**20:.0f} MiB of "
                       f"weights, {engine.kv.num_blocks} KV blocks)")
    except BaseException as e:
        log.exception("engine core failed to start")
        error = f"{type(e).__name__}: {e}"
        outbox.send(codec.encode(StartupFailed(error)))
        outbox.close()
        ctx.term()
        return f"the engine core failed to start: {error}"
    loop = EngineCoreLoop(engine, inbox, outbox, parent_pid, publish_blocks)
    loop.send(ready)
    if engine.parts.tokenizer is not None:   # constraints' tokenizer, off the step loop
        engine.grammars.prefetch_tokenizer()
    try:
        loop.run()
    except BaseException as e:
        return f"engine core failure: {type(e).__name__}: {e}"
    finally:
        engine.shutdown()
        inbox.close()
        outbox.close()
        ctx.term()
    return None
