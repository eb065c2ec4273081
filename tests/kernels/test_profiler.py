"""KernelSelector: policies, `supports` filtering, correctness gate, disk cache, token buckets.

Kernels here are reference ops wrapped to count their calls (a cached decision must run no
candidate) or deliberately broken (wrong, crashing, wrong shape) to show they are rejected with
a reason and never chosen, however fast.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tessellm.errors import ConfigError, KernelError
from tessellm.kernels import reference as ref
from tessellm.kernels.profiler import Decision, KernelSelector, ProfileCache, token_bucket
from tessellm.kernels.registry import Kernel, KernelQuery, KernelRegistry

DEV = "dev"
Q = KernelQuery("rms_norm", torch.float32, 8, (("hidden", 64),))
Q_BF16 = KernelQuery("rms_norm", torch.bfloat16, 8, (("hidden", 64),))


class Counted:
    """A kernel fn that counts its calls."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.fn(*args)


def _registry(*kernels: tuple[str, Callable[..., Any]], op: str = "rms_norm",
              supports: dict[str, Callable[[KernelQuery], bool]] | None = None) -> KernelRegistry:
    registry = KernelRegistry()
    for name, fn in kernels:
        extra = {"supports": supports[name]} if supports and name in supports else {}
        registry.register(Kernel(op, name, fn, DEV, **extra))
    return registry


def _selector(registry: KernelRegistry, **kw: Any) -> KernelSelector:
    kw.setdefault("min_time_s", 0.001)
    kw.setdefault("max_reps", 5)
    return KernelSelector(registry, DEV, "cpu", lambda: None, **kw)


def _slow_ref(x, weight, eps):
    time.sleep(0.0005)
    return ref.rms_norm(x, weight, eps)


def _wrong_but_fast():
    """rms_norm off by 1%, computed once and then returned from a cache: the fastest there is."""
    cached: list[torch.Tensor] = []

    def fn(x, weight, eps):
        if not cached:
            cached.append(ref.rms_norm(x, weight, eps) * 1.01)
        return cached[0]
    return fn


def _timed(c) -> bool:
    """Whether a ranking entry carries a measured time (whatever the field is called)."""
    return any(k.endswith("_us") and v is not None for k, v in asdict(c).items())


def _entry(decision: Decision, name: str):
    return next(c for c in decision.ranking if c.name == name)


# ------------------------------------------------------------------ correctness gate

def test_wrong_kernel_is_rejected_even_when_fastest() -> None:
    wrong = Counted(_wrong_but_fast())
    sel = _selector(_registry(("wrong_fast", wrong), ("slow_ref", _slow_ref)))
    decision = sel.decide(Q)
    assert decision.choice == "slow_ref"
    bad = _entry(decision, "wrong_fast")
    assert not bad.correct and "differs from reference" in bad.error and not _timed(bad)
    good = _entry(decision, "slow_ref")
    assert good.correct and _timed(good) and good.error == ""
    assert [c.name for c in decision.ranking] == ["slow_ref", "wrong_fast"]  # correct first
    assert sel.select(Q).name == "slow_ref"
    assert wrong.calls == 1  # checked once, never timed


def test_crashing_kernel_is_reported_and_not_chosen() -> None:
    def boom(x, weight, eps):
        raise RuntimeError("boom: unsupported layout")

    decision = _selector(_registry(("crashes", boom), ("ref", ref.rms_norm))).decide(Q)
    assert decision.choice == "ref"
    crashed = _entry(decision, "crashes")
    assert not crashed.correct and crashed.error == "RuntimeError: boom: unsupported layout"


def test_kernel_crashing_after_its_check_is_reported_and_not_chosen() -> None:
    calls = [0]

    def flaky(x, weight, eps):
        calls[0] += 1
        if calls[0] > 1:
            raise RuntimeError("out of scratch space")
        return ref.rms_norm(x, weight, eps)

    decision = _selector(_registry(("flaky", flaky), ("ref", ref.rms_norm))).decide(Q)
    assert decision.choice == "ref" and not _entry(decision, "flaky").correct


def test_wrong_shape_is_rejected() -> None:
    decision = _selector(_registry(("short", lambda x, w, e: ref.rms_norm(x, w, e)[:, :-1]),
                                   ("ref", ref.rms_norm))).decide(Q)
    assert decision.choice == "ref"
    assert "shape" in _entry(decision, "short").error


def test_every_output_of_a_tuple_op_is_checked() -> None:
    def wrong_sum(x, residual, weight, eps):
        normed, _ = ref.fused_add_rms_norm(x, residual, weight, eps)
        return normed, x - residual

    q = KernelQuery("fused_add_rms_norm", torch.float32, 4, (("hidden", 32),))
    registry = _registry(("wrong_sum", wrong_sum), ("ref", ref.fused_add_rms_norm),
                         op="fused_add_rms_norm")
    decision = _selector(registry).decide(q)
    assert decision.choice == "ref" and not _entry(decision, "wrong_sum").correct


def test_in_place_op_is_checked_on_the_written_argument() -> None:
    def swaps_k_and_v(k, v, kv_cache, slot_mapping):
        ref.write_kv_cache(v, k, kv_cache, slot_mapping)

    q = KernelQuery("write_kv_cache", torch.float32, 5, (("num_kv_heads", 2), ("head_dim", 8)))
    registry = _registry(("swapped", swaps_k_and_v), ("ref", ref.write_kv_cache),
                         op="write_kv_cache")
    decision = _selector(registry).decide(q)
    assert decision.choice == "ref" and not _entry(decision, "swapped").correct


def test_all_wrong_raises_with_every_reason() -> None:
    sel = _selector(_registry(("a", _wrong_but_fast()), ("b", lambda x, w, e: 1 / 0)))
    with pytest.raises(KernelError, match="disagrees with the reference") as info:
        sel.select(Q)
    assert "a: output differs" in str(info.value) and "b: ZeroDivisionError" in str(info.value)


def test_rms_norm_ignoring_eps_is_rejected() -> None:
    def no_eps(x, weight, eps):
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True))).to(x.dtype)

    decision = _selector(_registry(("no_eps", no_eps), ("ref", _slow_ref))).decide(Q)
    assert not _entry(decision, "no_eps").correct


# ------------------------------------------------------------------ disk cache

def test_decision_is_written_to_disk_and_reused_without_running(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "profile.json"
    a, b = Counted(ref.rms_norm), Counted(_slow_ref)
    sel = _selector(_registry(("a", a), ("b", b)), cache=ProfileCache(path), identity="v1")
    chosen = sel.select(Q).name
    assert chosen == "a" and a.calls > 1 and b.calls > 1
    data = json.loads(path.read_text())
    (key,) = data
    assert Q.bucket_key in key and "v1" in key and data[key]["choice"] == "a"
    assert [c["name"] for c in data[key]["ranking"]] == ["a", "b"]

    a2, b2 = Counted(ref.rms_norm), Counted(_slow_ref)
    sel2 = _selector(_registry(("a", a2), ("b", b2)), cache=ProfileCache(path), identity="v1")
    assert sel2.select(Q).name == "a"
    assert sel2.decide(Q).ranking[0].name == "a"
    assert a2.calls == b2.calls == 0


def test_changed_candidates_or_identity_give_new_keys(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    base = _registry(("a", ref.rms_norm), ("b", ref.rms_norm))
    more = _registry(("a", ref.rms_norm), ("b", ref.rms_norm), ("c", ref.rms_norm))
    sel = _selector(base, identity="v1")
    cands = base.candidates(DEV, Q)
    key = sel.cache_key(Q, cands)
    assert sel.cache_key(Q, more.candidates(DEV, Q)) != key
    assert sel.cache_key(Q, cands[:1]) != key
    assert _selector(base, identity="v2").cache_key(Q, cands) != key
    assert sel.cache_key(Q_BF16, cands) != key
    assert sel.cache_key(KernelQuery("rms_norm", torch.float32, 16, Q.dims), cands) != key
    assert sel.cache_key(KernelQuery("rms_norm", torch.float32, 8, (("hidden", 32),)), cands) != key

    _selector(base, cache=ProfileCache(path), identity="v1").select(Q)
    c = Counted(ref.rms_norm)
    more.register(Kernel("rms_norm", "d", c, DEV))
    _selector(more, cache=ProfileCache(path), identity="v1").select(Q)  # new set: profiles
    assert c.calls > 0
    c.calls = 0
    a = Counted(ref.rms_norm)
    _selector(_registry(("a", a), ("b", ref.rms_norm)), cache=ProfileCache(path),
              identity="v2").select(Q)  # new identity: profiles again
    assert a.calls > 0
    assert len(json.loads(path.read_text())) == 3


def test_corrupt_cache_file_is_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text("{not json")
    a = Counted(ref.rms_norm)
    sel = _selector(_registry(("a", a), ("b", ref.rms_norm)), cache=ProfileCache(path))
    assert sel.select(Q).name in ("a", "b") and a.calls > 0
    assert len(json.loads(path.read_text())) == 1


def test_cache_entry_of_another_schema_is_not_trusted(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    sel = _selector(_registry(("a", ref.rms_norm), ("b", ref.rms_norm)), cache=ProfileCache(path))
    key = sel.cache_key(Q, sel.registry.candidates(DEV, Q))
    path.write_text(json.dumps({key: {"choice": "a", "ranking": [
        {"name": "a", "median_us": 1.0, "correct": True, "error": ""},
        {"name": "b", "median_us": 2.0, "correct": True, "error": ""}]}}))
    fresh = _selector(_registry(("a", ref.rms_norm), ("b", ref.rms_norm)),
                      cache=ProfileCache(path))
    assert fresh.select(Q).name in ("a", "b")


def test_select_is_memoized_per_query() -> None:
    a = Counted(ref.rms_norm)
    sel = _selector(_registry(("a", a), ("b", ref.rms_norm)))
    first = sel.select(Q)
    calls = a.calls
    assert sel.select(Q) is first and a.calls == calls


# ------------------------------------------------------------------ policies and supports

def _f32_only(q: KernelQuery) -> bool:
    return q.dtype == torch.float32


def test_first_policy_picks_the_first_supported_without_profiling() -> None:
    f32, general = Counted(ref.rms_norm), Counted(ref.rms_norm)
    registry = _registry(("f32_only", f32), ("general", general),
                         supports={"f32_only": _f32_only})
    sel = _selector(registry, policy="first")
    assert sel.select(Q).name == "f32_only"
    assert sel.select(Q_BF16).name == "general"
    assert f32.calls == general.calls == 0


def test_supports_filters_candidates() -> None:
    f32 = Counted(ref.rms_norm)
    registry = _registry(("f32_only", f32), ("general", ref.rms_norm), ("general2", _slow_ref),
                         supports={"f32_only": _f32_only})
    assert [k.name for k in registry.candidates(DEV, Q_BF16)] == ["general", "general2"]
    assert [k.name for k in registry.candidates(DEV, Q)] == ["f32_only", "general", "general2"]
    decision = _selector(registry).decide(Q_BF16)
    assert {c.name for c in decision.ranking} == {"general", "general2"}
    assert f32.calls == 0
    # the only supporting kernel is taken without profiling
    only = _registry(("f32_only", f32), supports={"f32_only": _f32_only})
    assert _selector(only).select(Q).name == "f32_only" and f32.calls == 0
    with pytest.raises(KernelError, match="has no kernel for rms_norm|bfloat16"):
        _selector(only).select(Q_BF16)


def test_named_policy_picks_that_kernel_and_profiles_other_ops() -> None:
    a, b = Counted(ref.rms_norm), Counted(ref.rms_norm)
    registry = _registry(("a", a), ("b", b))
    add1, add2 = Counted(ref.add), Counted(ref.add)
    registry.register(Kernel("add", "add1", add1, DEV))
    registry.register(Kernel("add", "add2", add2, DEV))
    sel = _selector(registry, policy={"rms_norm": "b"})
    assert sel.select(Q).name == "b" and a.calls == b.calls == 0
    assert sel.select(KernelQuery("add", torch.float32, 4, (("features", 16),))).name in (
        "add1", "add2")
    assert add1.calls > 0 and add2.calls > 0


def test_named_policy_with_unknown_kernel_raises_config_error() -> None:
    registry = _registry(("a", ref.rms_norm), ("b", ref.rms_norm))
    with pytest.raises(ConfigError, match="'nope'.*it has \\['a', 'b'\\]"):
        _selector(registry, policy={"rms_norm": "nope"})
    with pytest.raises(ConfigError, match="'a'"):
        _selector(registry, policy={"silu": "a"})


def test_named_kernel_that_does_not_support_the_query_raises() -> None:
    registry = _registry(("f32_only", ref.rms_norm), ("general", ref.rms_norm),
                         supports={"f32_only": _f32_only})
    sel = _selector(registry, policy={"rms_norm": "f32_only"})
    assert sel.select(Q).name == "f32_only"
    with pytest.raises(KernelError, match="does not support"):
        sel.select(Q_BF16)


def test_unknown_policy_string_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="kernel_selection"):
        _selector(_registry(("a", ref.rms_norm)), policy="fastest")


def test_no_kernel_for_op_raises() -> None:
    with pytest.raises(KernelError, match="has no kernel"):
        _selector(_registry(("a", ref.rms_norm))).select(
            KernelQuery("silu", torch.float32, 1, (("features", 8),)))


def test_registering_a_name_twice_raises() -> None:
    registry = _registry(("a", ref.rms_norm))
    with pytest.raises(KernelError, match="registered twice"):
        registry.register(Kernel("rms_norm", "a", ref.rms_norm, DEV))
    registry.register(Kernel("rms_norm", "a", ref.rms_norm, "other_device"))  # other device: fine


@pytest.mark.parametrize(("tokens", "bucket"), [
    (0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (17, 32), (127, 128), (128, 128),
    (129, 256), (130, 256), (4096, 4096), (4097, 8192)])
def test_token_bucket(tokens: int, bucket: int) -> None:
    assert token_bucket(tokens) == bucket


def test_every_timed_call_starts_after_the_cache_flush() -> None:
    """The scratch buffer is written right before each timed call (never inside it), and the
    flush size is part of the cache key, so decisions made another way are not reused."""
    events: list[str] = []
    kernels = {name: Counted(ref.rms_norm) for name in ("a", "b")}
    for name, k in kernels.items():
        k.fn = (lambda n: lambda *a: events.append(n) or ref.rms_norm(*a))(name)
    sel = _selector(_registry(*kernels.items()), flush_bytes=1 << 16)
    real_flush = sel._flush_caches

    def flush():
        events.append("flush")
        real_flush()

    sel._flush_caches = flush
    sel.decide(Q)
    timed = events[events.index("flush"):]       # after the correctness runs
    assert timed.count("flush") == len(timed) // 2 >= 6   # >= 3 rounds x 2 candidates
    assert all(timed[i] == "flush" and timed[i + 1] in kernels for i in range(0, len(timed), 2))
    assert float(sel._scratch.min()) == 1.0 and sel._scratch.numel() == (1 << 16) // 4
    candidates = sel.registry.candidates(DEV, Q)
    assert "flush=65536" in sel.cache_key(Q, candidates)
    assert "flush=0" in _selector(_registry(*kernels.items()), flush_bytes=0).cache_key(
        Q, candidates)


def test_a_clear_loser_is_ranked_after_one_round_and_the_reference_is_not_run_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate 4x slower than the best after one timed round is not timed again (its
    ranking keeps its one sample); a candidate that is the reference op is correct without
    being run in the check."""
    calls = {"slow": 0, "ref_in_check": 0}
    in_check = [False]

    def slow(x, w, b=None):
        calls["slow"] += 1
        time.sleep(0.01)
        return torch.nn.functional.linear(x, w, b)

    real_ref = ref.REFERENCE_OPS["linear"]

    def counting_ref(*args):
        calls["ref_in_check"] += in_check[0]
        return real_ref(*args)

    monkeypatch.setitem(ref.REFERENCE_OPS, "linear", counting_ref)
    reg = KernelRegistry()
    reg.register(Kernel("linear", "fast", torch.nn.functional.linear, "cpu"))
    reg.register(Kernel("linear", "slow", slow, "cpu"))
    reg.register(Kernel("linear", "the_reference", counting_ref, "cpu"))
    sel = KernelSelector(reg, "cpu", "cpu", lambda: None, min_time_s=0.05)
    real_check = sel._check

    def spying_check(*args):
        in_check[0] = True
        try:
            return real_check(*args)
        finally:
            in_check[0] = False
    monkeypatch.setattr(sel, "_check", spying_check)
    query = KernelQuery("linear", torch.float32, 4,
                        (("bias", False), ("in_features", 16), ("out_features", 8)))
    decision = sel.decide(query)
    assert decision.choice in ("fast", "the_reference")
    assert calls["slow"] == 2          # its check and one timed round
    slow_c = next(c for c in decision.ranking if c.name == "slow")
    assert slow_c.correct and slow_c.best_us >= 1e4
    assert next(c for c in decision.ranking if c.name == "the_reference").correct
    assert calls["ref_in_check"] == 0
