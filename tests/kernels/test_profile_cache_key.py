"""The profile cache key names each candidate with a hash of its code, so a kernel whose code
changed under the same name is profiled again; the same code gives the same key, in this
process and in another one (no ids, no addresses, no string-hash order). Also: a profile cache
that cannot be written keeps its decisions in memory instead of failing the step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tessellm.kernels import reference as ref
from tessellm.kernels.kernel_code_hash import kernel_code_hash
from tessellm.kernels.profiler import KernelSelector, ProfileCache
from tessellm.kernels.registry import Kernel, KernelQuery, KernelRegistry, WeightLayout

DEV = "dev"
Q = KernelQuery("rms_norm", torch.float32, 8, (("hidden", 64),))
CALLS: dict[str, int] = {}


def rms_v1(x, weight, eps):
    CALLS["v1"] = CALLS.get("v1", 0) + 1
    return ref.rms_norm(x, weight, eps)


def rms_v2(x, weight, eps):   # the "edited" kernel: same name in the registry, other code
    CALLS["v2"] = CALLS.get("v2", 0) + 1
    return ref.rms_norm(x.clone(), weight, eps)


def _registry(fn) -> KernelRegistry:
    registry = KernelRegistry()
    registry.register(Kernel("rms_norm", "mine", fn, DEV))
    registry.register(Kernel("rms_norm", "other", ref.rms_norm, DEV))
    return registry


def _selector(registry: KernelRegistry, path: Path | None = None) -> KernelSelector:
    return KernelSelector(registry, DEV, "cpu", lambda: None, identity="same",
                          cache=ProfileCache(path), min_time_s=0.001, max_reps=3)


def _key(fn) -> str:
    registry = _registry(fn)
    return _selector(registry).cache_key(Q, registry.candidates(DEV, Q))


def test_changed_kernel_code_gives_a_new_key() -> None:
    assert _key(rms_v1) == _key(rms_v1)
    assert _key(rms_v1) != _key(rms_v2)
    # lambdas with other constants or other callees differ; the same lambda does not
    lam = lambda x, w, e: ref.rms_norm(x, w, e)   # noqa: E731
    assert _key(lam) == _key(lam)
    assert _key(lambda x, w, e: ref.rms_norm(x, w, e * 1.0)) != \
        _key(lambda x, w, e: ref.rms_norm(x, w, e * 2.0))
    assert _key(lambda x, w, e: ref.rms_norm(x, w, e)) != \
        _key(lambda x, w, e: ref.layer_norm(x, w, None, e))


class Wrapper:
    def __init__(self, fn, code_hash: str | None = None) -> None:
        self.fn, self.calls = fn, 0
        if code_hash is not None:
            self.code_hash = code_hash

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def test_callable_objects_hash_their_code_and_declared_hash() -> None:
    w = Wrapper(rms_v1)
    key = _key(w)
    w.calls = 41                                   # state that is not code: same key
    assert _key(w) == key == _key(Wrapper(rms_v1))
    assert _key(Wrapper(rms_v2)) != key            # the callable it wraps changed
    # a native kernel declares the hash of its built code (source, flags, compiler, CPU)
    assert _key(Wrapper(rms_v1, "abc")) == _key(Wrapper(rms_v1, "abc"))
    assert _key(Wrapper(rms_v1, "abc")) != _key(Wrapper(rms_v1, "abd"))


def test_weight_layout_prepare_is_part_of_the_hash() -> None:
    def k(prepare) -> Kernel:
        return Kernel("linear", "l", torch.nn.functional.linear, DEV,
                      weight_layout=WeightLayout("blocked", prepare))
    assert kernel_code_hash(k(torch.clone)) == kernel_code_hash(k(torch.clone))
    assert kernel_code_hash(k(lambda w: w.contiguous())) != \
        kernel_code_hash(k(lambda w: w.t().contiguous().t()))


def test_a_changed_kernel_is_profiled_again(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    CALLS.clear()
    _selector(_registry(rms_v1), path).select(Q)
    assert CALLS.get("v1", 0) > 0
    CALLS.clear()
    _selector(_registry(rms_v1), path).select(Q)           # unchanged: from the cache
    assert CALLS == {}
    _selector(_registry(rms_v2), path).select(Q)           # changed under the same name
    assert CALLS.get("v2", 0) > 0
    assert len(json.loads(path.read_text())) == 2


def test_cpu_kernel_keys_are_the_same_in_another_process() -> None:
    script = ("from tessellm_cpu.kernels import cpu_kernels\n"
              "from tessellm.kernels.kernel_code_hash import kernel_code_hash\n"
              "print({k.name: kernel_code_hash(k) for k in cpu_kernels('cpu')})\n")
    from tessellm_cpu.kernels import cpu_kernels
    here = str({k.name: kernel_code_hash(k) for k in cpu_kernels("cpu")})
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout.strip().splitlines()[-1]
    assert out == here
    assert "decode_native_paged" in here


def test_unwritable_profile_cache_keeps_decisions_in_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cache = ProfileCache(blocker / "sub" / "profile.json")
    sel = KernelSelector(_registry(rms_v1), DEV, "cpu", lambda: None, cache=cache,
                         min_time_s=0.001, max_reps=3)
    CALLS.clear()
    assert sel.select(Q).name in ("mine", "other")
    calls = CALLS.get("v1", 0)
    assert calls > 0
    assert sel.decide(Q).choice == sel.select(Q).name    # answered from memory
    assert CALLS.get("v1", 0) == calls
    assert not list(tmp_path.glob("**/*.tmp*"))
