"""The runtime kernel profiler and selector.

For a concrete KernelQuery (op, dtype, token bucket, model dims) on the active device, the
selector either takes the first supported candidate (`first`), a named kernel (`{op: name}`),
or profiles (`profile`): each candidate runs on seeded example inputs, its output is compared
with the reference op (a wrong kernel is rejected and the reason kept), and the fastest correct
one wins (minimum over interleaved timed rounds, with device synchronization; a candidate
more than 4x as slow as the best after one round, or 2x after three, is ranked on the samples
it has and no longer timed). Before every
timed call a scratch buffer of `flush_bytes` (default 8 MiB, several times a core's L2) is
written, so each call starts with caches as cold as in a forward pass, where every small op
follows a GEMM that streamed megabytes of weights: in a hot loop a chain of small torch ops
looked as fast as one C call while in the step it cost several times more (docs/architecture.md
has the measurement). Decisions and
rankings are cached in memory and on disk, keyed by device, library versions, the candidate set
(each name with a hash of its code, so an edited kernel is checked again) and the query, so a
restart does not re-profile. A cache file that cannot be written leaves the decisions in
memory only (a warning), never a failed step.

Replayed buckets: where the device runs a bucket's decode steps as a compiled replay (the
CPU plugin's native programs), a kernel's per-call host work (argument checks, allocation,
the crossing into native code) is paid once at recording, not per step. A kernel function
that offers `replay_timer(*args)` (returning a callable that runs the call as a replay runs
it, or None) is timed through it in those buckets; the others are timed as called, which is
how a replay runs them too (as Python nodes). Such decisions are cached apart.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from tessellm.errors import ConfigError, KernelError
from tessellm.kernels.examples import IN_PLACE_OUTPUT_ARG, make_example
from tessellm.kernels.reference import REFERENCE_OPS
from tessellm.kernels.kernel_code_hash import kernel_code_hash
from tessellm.kernels.registry import Kernel, KernelQuery, KernelRegistry

log = logging.getLogger(__name__)

TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 5e-3), torch.bfloat16: (1.6e-2, 5e-2)}
# Ops whose kernels round an intermediate they compute themselves to int8 (a silu-and-mul row
# before the int8 down projection): a value an ulp from a rounding boundary may land one
# level over in the kernel and not in the reference (C's expf against torch's sigmoid), which
# moves that token's row by about a level of the block (~1e-3 of the output's scale). Their
# absolute tolerance is at least this; a wrong expert, row or scale is off by the outputs
# themselves (order 1 on the example inputs).
ROUNDED_INTERMEDIATE_ATOL = {"fused_moe_packed_q8act": 1e-2}


def check_tolerance(op: str, dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) a kernel of `op` must meet against the reference op in `dtype`."""
    rtol, atol = TOLERANCES.get(dtype, (1e-5, 1e-4))
    return rtol, max(atol, ROUNDED_INTERMEDIATE_ATOL.get(op, 0.0))


def token_bucket(num_tokens: int) -> int:
    """Smallest power of two >= num_tokens (min 1): the profiling bucket of a token count."""
    return 1 << max(0, (max(1, num_tokens) - 1).bit_length())


@dataclass(slots=True)
class Candidate:
    name: str
    best_us: float | None  # minimum time over interleaved rounds, microseconds
    correct: bool
    error: str = ""


@dataclass(slots=True)
class Decision:
    choice: str
    ranking: list[Candidate]


class ProfileCache:
    """Decisions on disk as one JSON file: {key: {"choice": name, "ranking": [...]}}."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._data: dict[str, Any] = {}
        self._warned = False
        if path is not None and path.exists():
            try:
                self._data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                self._data = {}  # a corrupt cache is rebuilt, never trusted

    def get(self, key: str) -> Decision | None:
        entry = self._data.get(key)
        try:
            return Decision(entry["choice"], [Candidate(**c) for c in entry["ranking"]])
        except (KeyError, TypeError):  # absent, or written by another schema: re-profile
            return None

    def put(self, key: str, decision: Decision) -> None:
        self._data[key] = {"choice": decision.choice, "ranking": [asdict(c) for c in decision.ranking]}
        if self.path is None:
            return
        tmp = self.path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self._data, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as e:  # an unwritable cache dir costs re-profiling, never a failed step
            if not self._warned:
                log.warning("kernel profile cache %s not written (decisions kept in memory "
                            "only): %s: %s", self.path, type(e).__name__, e)
                self._warned = True
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass


def _outputs(op: str, args: list[Any], result: Any) -> list[torch.Tensor]:
    if op in IN_PLACE_OUTPUT_ARG:
        return [args[IN_PLACE_OUTPUT_ARG[op]]]
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _clone_args(args: list[Any]) -> list[Any]:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


class KernelSelector:
    """Chooses one kernel per KernelQuery for one device.

    policy: "profile" | "first" | {op: kernel_name} (ops not named fall back to "profile").
    """

    def __init__(self, registry: KernelRegistry, device_name: str, torch_device: str,
                 synchronize: Callable[[], None], policy: str | Mapping[str, str] = "profile",
                 cache: ProfileCache | None = None, identity: str = "",
                 min_time_s: float = 0.005, max_reps: int = 50,
                 flush_bytes: int = 8 << 20,
                 replayed_buckets: frozenset[int] = frozenset()) -> None:
        if isinstance(policy, str) and policy not in ("profile", "first"):
            raise ConfigError(f"kernel_selection must be 'profile', 'first' or a mapping "
                              f"op -> kernel name, got {policy!r}")
        self.registry = registry
        self.device_name = device_name
        self.torch_device = torch_device
        self.synchronize = synchronize
        self.policy = policy
        self.cache = cache or ProfileCache(None)
        self.identity = identity
        self.min_time_s = min_time_s
        self.max_reps = max_reps
        self.flush_bytes = flush_bytes
        self.replayed_buckets = replayed_buckets   # token buckets run as compiled replays
        self._scratch: torch.Tensor | None = None
        self._chosen: dict[KernelQuery, Kernel] = {}
        self.profiled = 0   # queries measured (not found in the cache) so far
        self._example_weights: dict[tuple[Any, ...], Any] = {}   # make_example's memo
        if isinstance(policy, Mapping):
            for op, name in policy.items():
                if name not in {k.name for k in registry.kernels(device_name, op)}:
                    raise ConfigError(f"kernel_selection names kernel {name!r} for op {op!r}, "
                                      f"which device {device_name!r} does not have; it has "
                                      f"{[k.name for k in registry.kernels(device_name, op)]}")

    def select(self, query: KernelQuery) -> Kernel:
        kernel = self._chosen.get(query)
        if kernel is None:
            kernel = self._select(query)
            self._chosen[query] = kernel
        return kernel

    def _select(self, query: KernelQuery) -> Kernel:
        candidates = self.registry.candidates(self.device_name, query)
        if not candidates:
            raise KernelError(f"device {self.device_name!r} has no kernel for {query.bucket_key}")
        if isinstance(self.policy, Mapping) and query.op in self.policy:
            named = [k for k in candidates if k.name == self.policy[query.op]]
            if not named:
                raise KernelError(f"kernel {self.policy[query.op]!r} does not support "
                                  f"{query.bucket_key}")
            return named[0]
        if self.policy == "first" or len(candidates) == 1:
            return candidates[0]
        decision = self.decide(query, candidates)
        return next(k for k in candidates if k.name == decision.choice)

    def release_examples(self) -> None:
        """Drop the example weights kept for profiling (choose_kernels calls this when every
        bucket is chosen; a later profile makes them again)."""
        self._example_weights.clear()

    def chosen(self) -> dict[KernelQuery, str]:
        """Every query answered so far -> the kernel chosen for it."""
        return {q: k.name for q, k in self._chosen.items()}

    def best(self, query: KernelQuery, accept: Callable[[Kernel], bool]) -> Kernel | None:
        """The fastest candidate `accept` takes that the profile found correct (None if no
        such candidate, or the policy does not profile)."""
        candidates = [k for k in self.registry.candidates(self.device_name, query) if accept(k)]
        if not candidates:
            return None
        if self.policy != "profile":
            return candidates[0]
        by_name = {k.name: k for k in candidates}
        for c in self.decide(query).ranking:
            if c.correct and c.name in by_name:
                return by_name[c.name]
        return None

    def slowdown(self, query: KernelQuery, accept: Callable[[Kernel], bool]) -> float:
        """How many times slower the fastest correct candidate `accept` takes is than the
        fastest correct candidate of all (>= 1); inf if it takes none. 1.0 for any it takes
        when the policy does not profile (no times to compare)."""
        candidates = self.registry.candidates(self.device_name, query)
        if not any(accept(k) for k in candidates):
            return float("inf")
        if self.policy != "profile":
            return 1.0
        by_name = {k.name: k for k in candidates}
        timed = [(c.best_us, accept(by_name[c.name])) for c in self.decide(query).ranking
                 if c.correct and c.best_us is not None and c.name in by_name]
        taken = [us for us, ok in timed if ok]
        if not taken:
            return float("inf")
        return min(taken) / max(min(us for us, _ in timed), 1e-9)

    def cache_key(self, query: KernelQuery, candidates: list[Kernel]) -> str:
        """Device, identity, query and each candidate as name@code-hash: a kernel whose code
        changed under the same name (an edited plugin, a rebuilt C kernel) is profiled again."""
        names = ",".join(f"{k.name}@{kernel_code_hash(k)}" for k in candidates)
        replay = "|replay" if self._replayed(query, candidates) else ""
        return (f"{self.device_name}|{self.identity}|flush={self.flush_bytes}|"
                f"{query.bucket_key}{replay}|[{names}]")

    def _replayed(self, query: KernelQuery, candidates: list[Kernel]) -> bool:
        """Whether `query`'s candidates are timed as a replay runs them (module docstring)."""
        return query.num_tokens in self.replayed_buckets and any(
            hasattr(k.fn, "replay_timer") for k in candidates)

    def decide(self, query: KernelQuery, candidates: list[Kernel] | None = None) -> Decision:
        """The profiled decision for a query (from cache, or measured now)."""
        candidates = candidates or self.registry.candidates(self.device_name, query)
        key = self.cache_key(query, candidates)
        decision = self.cache.get(key)
        if decision is None:
            decision = self._profile(query, candidates)
            self.profiled += 1
            self.cache.put(key, decision)
        return decision

    def _profile(self, query: KernelQuery, candidates: list[Kernel]) -> Decision:
        args = make_example(query, self.torch_device, self._example_weights)
        ref_args = _clone_args(args)
        expected = _outputs(query.op, ref_args, REFERENCE_OPS[query.op](*ref_args))
        rtol, atol = check_tolerance(query.op, query.dtype)
        checked = [self._check(k, query.op, args, expected, rtol, atol) for k in candidates]
        rejected = [c for c, _ in checked if not c.correct]
        timed = [(c, k_args) for c, k_args in checked if c.correct]
        if not timed:
            raise KernelError(f"every kernel for {query.bucket_key} on {self.device_name!r} "
                              f"disagrees with the reference: "
                              + "; ".join(f"{c.name}: {c.error}" for c in rejected))
        calls = self._timed_calls(query, candidates, timed)
        samples: dict[str, list[float]] = {c.name: [] for c, _ in timed}
        deadline = time.perf_counter() + self.min_time_s * len(timed)
        # Interleaved rounds: interference from other processes hits every candidate alike;
        # the minimum is the estimate least disturbed by it.
        dropped: set[str] = set()
        for rnd in range(self.max_reps):
            if rnd >= 3 and time.perf_counter() > deadline:
                break
            if rnd >= 1:   # a clear loser is ranked on the samples it has, not retimed:
                best = min(min(v) for v in samples.values() if v)   # 4x after one round,
                bound = 2 * best if rnd >= 3 else 4 * best           # 2x after three
                dropped |= {n for n, v in samples.items() if v and min(v) > bound}
            for c, k_args in timed:
                if not c.correct or c.name in dropped:
                    continue
                try:
                    self._flush_caches()
                    self.synchronize()
                    t0 = time.perf_counter()
                    calls[c.name]()
                    self.synchronize()
                except Exception as e:  # crashed while timed: reported, never chosen
                    c.correct, c.error = False, f"{type(e).__name__} while timed: {e}"
                    continue
                samples[c.name].append(time.perf_counter() - t0)
        for c, _ in timed:
            c.best_us = min(samples[c.name]) * 1e6 if c.correct else None
        survivors = sorted((c for c, _ in timed if c.correct), key=lambda c: c.best_us)
        if not survivors:
            raise KernelError(f"every kernel for {query.bucket_key} on {self.device_name!r} "
                              "failed: " + "; ".join(f"{c.name}: {c.error}" for c, _ in timed))
        ranking = survivors + [c for c, _ in timed if not c.correct] + rejected
        return Decision(ranking[0].name, ranking)

    def _timed_calls(self, query: KernelQuery, candidates: list[Kernel],
                     timed: list[tuple[Candidate, list[Any]]]) -> dict[str, Callable[[], Any]]:
        """Per correct candidate, the call to time: through its replay_timer in a replayed
        bucket (when it offers one and it accepts the arguments), else the call itself."""
        fns = {k.name: k.fn for k in candidates}
        replay = self._replayed(query, candidates)
        calls: dict[str, Callable[[], Any]] = {}
        for c, k_args in timed:
            fn = fns[c.name]
            timer = getattr(fn, "replay_timer", None) if replay else None
            call = None
            if timer is not None:
                try:
                    call = timer(*k_args)
                except Exception as e:  # a kernel that cannot replay is timed as called
                    log.debug("%s: no replay timer for %s: %s", c.name, query.bucket_key, e)
            calls[c.name] = call or (lambda fn=fn, a=k_args: fn(*a))
        return calls

    def _flush_caches(self) -> None:
        """Write the scratch buffer (see the module docstring); nothing when flush_bytes=0."""
        if not self.flush_bytes:
            return
        if self._scratch is None:
            self._scratch = torch.empty(self.flush_bytes // 4, dtype=torch.float32,
                                        device=self.torch_device)
        self._scratch.fill_(1.0)

    def _check(self, kernel: Kernel, op: str, args: list[Any], expected: list[torch.Tensor],
               rtol: float, atol: float) -> tuple[Candidate, list[Any]]:
        """Run once on a private copy of the inputs (the weight in the kernel's own layout,
        prepared before anything is timed) and compare with the reference. A candidate that
        is the reference op itself is correct by definition (not run twice)."""
        run_args = _clone_args(args)
        if kernel.fn is REFERENCE_OPS.get(op) and kernel.weight_layout is None:
            return Candidate(kernel.name, None, True), run_args
        try:
            if kernel.weight_layout is not None:
                run_args[1] = kernel.weight_layout.prepare(run_args[1])
            got = _outputs(op, run_args, kernel.fn(*run_args))
            for g, e in zip(got, expected, strict=True):
                if g.shape != e.shape:
                    return Candidate(kernel.name, None, False,
                                     f"output shape {tuple(g.shape)} != reference {tuple(e.shape)}"), run_args
                if not e.dtype.is_floating_point:   # ids, counts: exact
                    if not torch.equal(g.cpu(), e.cpu()):
                        return Candidate(kernel.name, None, False,
                                         "integer output differs from reference"), run_args
                    continue
                if not torch.allclose(g.float(), e.float(), rtol=rtol, atol=atol):
                    diff = (g.float() - e.float()).abs().max().item()
                    return Candidate(kernel.name, None, False, f"output differs from reference "
                                     f"(max abs diff {diff:.3g}, rtol {rtol}, atol {atol})"), run_args
        except Exception as e:  # a crashing candidate is reported and skipped, never chosen
            return Candidate(kernel.name, None, False, f"{type(e).__name__}: {e}"), run_args
        return Candidate(kernel.name, None, True), run_args
