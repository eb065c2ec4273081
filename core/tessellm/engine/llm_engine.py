"""LLMEngine: the engine loop. `step()` is schedule, launch, update.

Async scheduling (`async_scheduling`; on by default where the device runs asynchronously,
cuda): a step is launched, committed (its computed counts move and each request completing
in it holds a pending token), and kept in flight; the next step() schedules and launches the
following step while the device still runs it (its pending tokens are fed on the device),
and only then waits for the in-flight step's ids and completes it. So the host prepares step
N+1 while the device runs step N, and step() returns step N's finished requests one call
later. A step is kept in flight only when the next one cannot depend on its ids on the host:
none of its rows forks siblings (n > 1) or uses a penalty (the penalties read the ids).
Requests finished by EOS at step N were already scheduled into N+1; that token is dropped.

Speculation (`speculative_config`, tessellm.speculative): before each schedule the Speculator
gives eligible decoding requests draft tokens; the step computes them as extra rows and samples
at each, `Speculator.verify` accepts the drafts the draws agree with, and the scheduler appends them with
the correction (rejected drafts' blocks freed). A step with drafts is never kept in flight, and
a request with a token in flight gets no drafts (acceptance decides the next step's inputs),
so a step is kept in flight only when the speculator does not want its ids on the host
(Speculator.wants_ids: no request it would draft for now).
"""
from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, replace

from tessellm.cache.kv_groups import KVCacheLayout, check_pool_holds_a_window, make_kv_cache
from tessellm.constraints.compiler import GrammarCompiler
from tessellm.constraints.guidance_tokenizer import guidance_tokenizer
from tessellm.constraints.request_constraint import RequestConstraint
from tessellm.engine.builder import EngineParts
from tessellm.engine.runner_factory import make_model_runner
from tessellm.engine.step_inputs import LaunchedStep
from tessellm.engine.request_limits import RequestLimits
from tessellm.engine.stage_times import StageTimes
from tessellm.errors import InvalidRequestError, TessellmError
from tessellm.lora.manager import LoRAManager
from tessellm.lora.request import LoRARequest
from tessellm.parallel.group import ParallelGroupError
from tessellm.request import FinishReason, Request, sample_ids
from tessellm.sampling_params import SamplingParams
from tessellm.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, SLAConfig
from tessellm.speculative.proposer import make_proposer
from tessellm.speculative.speculator import Speculator


class StepError(TessellmError, RuntimeError):
    """An engine step raised; `failed` are the requests of that step (finished with ERROR)."""

    def __init__(self, message: str, failed: list[Request]) -> None:
        super().__init__(message)
        self.failed = failed


LOST_RANK_GRACE_S = 2.0   # how long a failed step waits to see which worker died


@dataclass(slots=True)
class StepStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_swapped_out_blocks: int = 0   # swap preemption traffic, device -> host
    num_swapped_in_blocks: int = 0    # and back
    num_overlapped_steps: int = 0     # launched while the previous step was in flight


class LLMEngine:
    """With tensor parallelism, a failing step or a lost rank is fatal (the ranks may be out
    of step): every unfinished request fails, the engine is dead (`dead` says why) and every
    later step raises ParallelGroupError."""

    def __init__(self, parts: EngineParts) -> None:
        c = parts.config
        self.parts = parts
        self.max_model_len = parts.max_model_len
        # one block-table group per attention kind: each windowed group releases the blocks
        # out of its window (tessellm.cache.kv_groups)
        layout = parts.kv_layout or KVCacheLayout.of([0] * len(parts.kv_caches))
        self.kv = make_kv_cache(parts.num_kv_blocks, c.block_size, layout.windows,
                                c.enable_prefix_caching)
        check_pool_holds_a_window(self.kv, self.max_model_len)
        sla = None if c.sla_itl_p99_ms is None else SLAConfig(
            c.sla_itl_p99_ms / 1e3, c.sla_target_tokens_per_s, c.sla_window_steps,
            c.sla_min_num_seqs)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=self.max_model_len, priority_levels=c.priority_levels,
            aging_interval_steps=c.aging_interval_steps, sla=sla,
            preemption_mode=c.preemption_mode, num_host_blocks=parts.num_host_kv_blocks,
            max_loras=c.max_loras if c.enable_lora else 0), self.kv)
        self.runner = make_model_runner(parts)
        self.stats = StepStats()
        self.limits = RequestLimits(
            c.priority_levels, parts.spec.vocab_size, self.max_model_len, c.block_size,
            self.kv.num_blocks, prompt_logprobs=parts.device.static_shapes(
                c.max_num_batched_tokens, c.max_num_seqs) is None,
            speculative_tokens=0 if c.speculative_config is None
            else c.speculative_config.num_speculative_tokens, kv_windows=layout.windows,
            step_tokens=c.max_num_batched_tokens)
        self._ids = itertools.count()
        self.grammars = GrammarCompiler(lambda: guidance_tokenizer(
            parts.tokenizer, parts.spec.vocab_size, parts.eos_token_ids))
        spec = c.speculative_config
        self.speculator = None if spec is None else Speculator(
            spec, make_proposer(spec, parts, parts.proposers), self.max_model_len)
        self.lora = LoRAManager.of(parts)
        self._in_flight: LaunchedStep | None = None
        self._in_flight_t0 = 0.0
        self._last_completed = 0.0
        self.dead: str | None = None
        if parts.parallel is not None:   # the workers stop with this engine, or at exit
            weakref.finalize(self, parts.parallel.shutdown)

    def check_alive(self) -> None:
        """Raise ParallelGroupError if the engine is dead or a rank of its group is gone."""
        if self.dead is not None:
            raise ParallelGroupError(self.dead)
        group = self.parts.parallel
        if group is not None:
            try:
                group.check_alive()
            except ParallelGroupError as e:
                self._die(str(e))
                raise

    def wait_for_ranks(self) -> None:
        """Tensor parallelism: until every rank is ready for the first step (once)."""
        if self.parts.parallel is not None:
            self.parts.parallel.wait_ready()

    def _die(self, reason: str) -> list[Request]:
        self.dead = reason
        self._in_flight = None
        return self.finish_requests(self.scheduler.unfinished_request_ids(),
                                    FinishReason.ERROR)

    def shutdown(self) -> None:
        """Stop the group's other ranks (tensor parallelism); the engine cannot step after."""
        if self.parts.parallel is not None:
            self.dead = self.dead or "the engine was shut down"
            self.parts.parallel.shutdown()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, n: int = 1, cache_salt: str | None = None) -> None:
        """Raise InvalidRequestError if the request can never run here (RequestLimits, the
        rules the server's front end applies too). Reads only immutable configuration."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError(
                f"cache_salt must be a string, got {type(cache_salt).__name__}")
        self.limits.validate(prompt_token_ids, params, priority, n)

    def _constraint(self, params: SamplingParams) -> RequestConstraint | None:
        """A new matcher for a constrained request (InvalidRequestError for a bad spec)."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.parts.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer, so it cannot constrain "
                                      "outputs")
        return RequestConstraint(self.grammars.matcher(spec))

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, cache_salt: str | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> Request:
        """Validate and queue a request; raises InvalidRequestError (nothing is queued then).
        `cache_salt`: only requests with the same salt share prefix-cache blocks.
        `priority`: 0 (most urgent, the default) .. priority_levels - 1; a waiting request
        evicts running ones of a lower priority when the KV pool or the batch is full.
        `lora_request`: the LoRA adapter to run with (enable_lora; None: the base model)."""
        return self.add_request_group(prompt_token_ids, params, 1, request_id, cache_salt,
                                      priority, lora_request)[0]

    def add_request_group(self, prompt_token_ids: list[int], params: SamplingParams, n: int,
                          request_id: str | None = None, cache_salt: str | None = None,
                          priority: int = 0, lora_request: LoRARequest | None = None
                          ) -> list[Request]:
        """Validate and queue `n` samples of one prompt (n > 1: copy-on-write siblings that
        share the prompt's KV blocks and compute it once; see tessellm.scheduling.forks).
        Sample i has id sample_ids(base, n)[i] and, when params.seed is set, seed
        params.seed + i. Raises InvalidRequestError (nothing is queued then)."""
        self.validate(prompt_token_ids, params, priority, n, cache_salt)
        return self.queue_request_group(prompt_token_ids, params, n, request_id, cache_salt,
                                        priority, lora_request)

    def queue_request_group(self, prompt_token_ids: list[int], params: SamplingParams, n: int,
                            request_id: str | None = None, cache_salt: str | None = None,
                            priority: int = 0, lora_request: LoRARequest | None = None
                            ) -> list[Request]:
        """Queue a request validated where it entered (the engine core's: by the server's
        front end, with the RequestLimits of `Ready`). Only its constraint is compiled here
        (InvalidRequestError for a spec the front end could not check without a tokenizer;
        nothing is queued then), and its adapter read if not cached (InvalidRequestError for
        one that cannot be used)."""
        base = request_id or f"req-{next(self._ids)}"
        now = time.monotonic()
        adapter = LoRAManager.adapter_of(self.lora, lora_request)
        constraint = self._constraint(params)
        requests = [
            Request(rid, list(prompt_token_ids),
                    params if params.seed is None else replace(params, seed=params.seed + i),
                    now, eos_token_ids=self.parts.eos_token_ids, cache_salt=cache_salt,
                    priority=priority,
                    constraint=constraint if constraint is None or n == 1
                    else constraint.fork(), adapter=adapter)
            for i, rid in enumerate(sample_ids(base, n))]
        if n == 1:
            self.scheduler.add_request(requests[0])
        else:
            self.scheduler.add_request_group(requests[0], requests[1:])
        if self.lora is not None:   # counted once queued: a refused request counts nowhere
            self.lora.count_queued(requests)
        return requests

    def abort(self, request_id: str) -> None:
        self.finish_requests([request_id], FinishReason.ABORT)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason
                        ) -> list[Request]:
        """Finish the named unfinished requests (Scheduler.finish_requests) and drop what
        speculation holds for them; every caller outside the engine goes through here."""
        return self._release(self.scheduler.finish_requests(request_ids, reason))

    def _release(self, finished: list[Request]) -> list[Request]:
        """Finished requests drop what speculation holds for them (and count their tokens
        per adapter); returns `finished`."""
        if self.speculator is not None:
            for request in finished:
                self.speculator.release(request)
        if self.lora is not None:
            self.lora.count_finished(finished)
        return finished

    def has_unfinished(self) -> bool:
        """Unfinished requests, or a step still in flight (async scheduling)."""
        return self.scheduler.has_unfinished or self._in_flight is not None

    @property
    def async_scheduling(self) -> bool:
        return self.runner.overlap

    def step(self) -> list[Request]:
        """One engine step: schedule, run, sample, update; returns the requests that finished
        in it. With async scheduling the step this call completes is the one launched by the
        previous call (`_step_overlapped`)."""
        if self.parts.parallel is not None:
            self.check_alive()
            self.wait_for_ranks()
        if self.runner.overlap:
            return self._step_overlapped()
        t0 = time.perf_counter()
        out = self._schedule()
        if not out.scheduled:
            self._block_ops_only(out)
            return []
        launched = self._launch(out)
        return self._complete(launched, t0)

    def _step_overlapped(self) -> list[Request]:
        """Async scheduling: launch step N+1, then complete step N (in flight since the last
        call). N+1 stays in flight unless a row's next logits need its ids on the host
        (`_can_stay_in_flight`); then it completes now too. A failing N does not stop N+1."""
        previous, previous_t0 = self._in_flight, self._in_flight_t0
        self._in_flight = None
        t0 = time.perf_counter()
        out = self._schedule()
        if not out.scheduled:
            finished = self._complete(previous, previous_t0) if previous is not None else []
            self._block_ops_only(out)
            return finished
        launched = self._launch(out, previous, previous_t0)
        if previous is not None:
            self.stats.num_overlapped_steps += 1
        stay = self._can_stay_in_flight(launched)
        self._in_flight, self._in_flight_t0 = launched, t0   # in flight while N completes
        try:
            finished = self._complete(previous, previous_t0) if previous is not None else []
        except StepError as error:   # step N failed; N+1 goes on as it would have
            if not stay:
                self._in_flight = None
                try:
                    self._complete(launched, t0)
                except StepError as also:
                    error.failed += also.failed
            raise
        if stay:
            return finished
        self._in_flight = None
        return finished + self._complete(launched, t0)

    def _schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        if self.speculator is not None:   # drafts for this step's decodes
            self.speculator.propose(self.scheduler.running,
                                    self.parts.config.max_num_batched_tokens)
        out = self.scheduler.schedule()
        self.stage_times.add("schedule", time.perf_counter() - t0)
        self.stats.num_swapped_out_blocks += len(out.swap_out)
        self.stats.num_swapped_in_blocks += len(out.swap_in)
        return out

    def _launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None,
                previous_t0: float = 0.0) -> LaunchedStep:
        """Enqueue the step and commit it in the scheduler. A step that fails to launch fails
        its requests (StepError, or ParallelGroupError when fatal); `previous`, a step in
        flight, still completes first."""
        try:
            if self.lora is not None:   # the step's adapters into device slots (every rank's)
                self.lora.assign([s.request for s in out.scheduled],
                                 self.runner.send_to_followers)
            launched = self.runner.launch(out, self.kv, previous)
        except Exception as exc:
            error = self._fail_step(out, exc)
            if previous is not None:
                try:
                    self._complete(previous, previous_t0)
                except StepError as also:
                    if isinstance(error, StepError):
                        error.failed += also.failed
            raise error from exc
        self._count_prompt_tokens(out)
        self.scheduler.commit(out)
        return launched

    def _can_stay_in_flight(self, step: LaunchedStep) -> bool:
        """Whether the next step may be scheduled before this one's ids are on the host (not
        when a row's next logits depend on its ids on the host: penalties, a constraint; nor
        when acceptance decides the next inputs, or the speculator would draft from them)."""
        if step.out.forks or step.out.has_drafts:
            return False
        if self.speculator is not None and self.speculator.wants_ids(step.sampled):
            return False
        return not any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty
                       or r.params.frequency_penalty or r.constraint is not None
                       for r in step.sampled)

    def _fail_step(self, out, exc: Exception) -> Exception:
        """Fail a step's requests (freeing their blocks); returns the error to raise: a
        StepError naming them, or with tensor parallelism ParallelGroupError (fatal)."""
        if self.parts.parallel is not None:   # the ranks may be out of step: fatal
            reason = (f"{self._lost_rank()}a step failed on rank 0 "
                      f"({type(exc).__name__}: {exc})")
            failed = self._die(reason)
            return ParallelGroupError(f"{reason}; {len(failed)} unfinished request(s) failed")
        # Only this step's requests fail; their blocks are freed and the engine goes on.
        failed = self.finish_requests([s.request.request_id for s in out.scheduled],
                                      FinishReason.ERROR)
        return StepError(f"engine step failed for {len(failed)} request(s): "
                         f"{type(exc).__name__}: {exc}", failed)

    def _complete(self, step: LaunchedStep, t0: float) -> list[Request]:
        """Wait for a launched (committed) step's ids and complete it in the scheduler. The
        SLA policy sees the time since the step was scheduled, or since the previous step
        completed when that is later (steps in flight overlap)."""
        try:
            token_ids = self.runner.collect(step)
        except Exception as exc:
            raise self._fail_step(step.out, exc) from exc
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(step.out.preempted)
        for s in step.out.scheduled:   # prompt logprobs first: entries in position order
            lps = step.prompt_logprobs.get(s.request.request_id)
            if lps and not s.request.is_finished:
                s.request.prompt_logprobs += lps
        sampled: dict[str, int] = {}
        accepted: dict[str, tuple[int, ...]] = {}
        skip: set[int] = set()   # verify rows whose tokens are accepted drafts or rejected
        if step.out.has_drafts:
            accepted, skip, rejected = self.speculator.verify(step, token_ids)
            self.stats.num_generated_tokens -= rejected
        self.stats.num_generated_tokens += len(token_ids)
        for i, (request, token, lp) in enumerate(zip(step.sampled, token_ids, step.logprobs)):
            if request.is_finished or i in skip:   # finished (aborted, EOS) since launched
                continue
            sampled[request.request_id] = token
            if lp is not None:
                request.output_logprobs.append(lp)
        t1 = time.perf_counter()
        finished = self.scheduler.complete(step.out, sampled, accepted)
        t2 = time.perf_counter()
        if accepted:   # logprobs of verify rows past a finish are dropped
            for rid in accepted:
                r = step.sampled[step.rows[rid]]
                del r.output_logprobs[len(r.output_token_ids):]
        self.stage_times.add("update", t2 - t1)
        seconds = t2 - max(t0, self._last_completed)
        self.scheduler.observe_step(seconds, step.out.num_decodes)
        if self.speculator is not None:
            self.speculator.observe_step(seconds, step.out.num_batched_tokens,
                                         step.out.has_drafts)
        self._last_completed = t2
        return self._release(finished)

    def _lost_rank(self) -> str:
        """The start of a parallel engine's death notice: which rank is gone, when a local
        worker exited (or exits within a moment: a peer's death is often what failed the
        step)."""
        try:
            self.parts.parallel.check_alive(grace_s=LOST_RANK_GRACE_S)
        except ParallelGroupError as e:
            return f"parallel engine stopped: {e}; "
        return "parallel engine stopped: "

    def _block_ops_only(self, out: SchedulerOutput) -> None:
        """A step that scheduled no tokens may still have block work (its preemptions'
        swap-outs): run it."""
        if not out.has_block_ops:
            return
        try:
            self.runner.apply_block_ops(out, self.kv)
        except Exception as exc:
            if self.parts.parallel is None:
                raise
            reason = f"{self._lost_rank()}{type(exc).__name__}: {exc}"
            self._die(reason)
            raise ParallelGroupError(reason) from exc

    @property
    def stage_times(self) -> StageTimes:
        """Cumulative seconds per engine stage (the runner's and the engine's own)."""
        return self.runner.stage_times

    def _count_prompt_tokens(self, out) -> None:
        for s in out.scheduled:  # prompt positions among the tokens computed this step
            start, n_prompt = s.request.num_computed_tokens, s.request.num_prompt_tokens
            self.stats.num_prompt_tokens += max(0, min(start + s.num_tokens, n_prompt) - start)
