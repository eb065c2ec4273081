"""Fake plugins for the plugin-manager tests, each reached by a fake entry point
"broken_plugins:<attribute>". Each attribute is a plugin object: a namespace carrying
TESSELLM_API_VERSION and hook implementations, as a plugin module would."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch

from tessellm.plugin_api import (
    Architecture,
    Availability,
    DeviceAllocator,
    DevicePlugin,
    GraphPass,
    Kernel,
    MemoryInfo,
    ModelGraph,
    SynchronousStream,
    TransferStream,
    adapt_llama_weights,
    build_llama_graph,
    hookimpl,
    llama_family_spec,
)


class FakeDevice(DevicePlugin):
    """A host-memory device whose availability, probe and kernels are set by the test."""

    torch_device_type = "cpu"

    def __init__(self, name: str, priority: int = 0, available: bool = True, reason: str = "",
                 probe_error: Exception | None = None, kernels_error: Exception | None = None) -> None:
        self.name = name
        self.priority = priority
        self._availability = Availability(available, reason)
        self._probe_error = probe_error
        self._kernels_error = kernels_error
        self._allocator = DeviceAllocator("cpu", 1 << 20)

    def is_available(self) -> Availability:
        if self._probe_error is not None:
            raise self._probe_error
        return self._availability

    def memory_info(self) -> MemoryInfo:
        return MemoryInfo(1 << 20, self._allocator.free_bytes)

    def allocator(self) -> DeviceAllocator:
        return self._allocator

    def new_stream(self) -> TransferStream:
        return SynchronousStream()

    def kernels(self) -> list[Kernel]:
        if self._kernels_error is not None:
            raise self._kernels_error
        return [Kernel("add", f"{self.name}_add", torch.add, self.name)]


def _plugin(api_version: str | None = "1.0", **hooks: Callable[[], Any]) -> SimpleNamespace:
    attrs: dict[str, Any] = {name: hookimpl(fn) for name, fn in hooks.items()}
    if api_version is not None:
        attrs["TESSELLM_API_VERSION"] = api_version
    return SimpleNamespace(**attrs)


def _devices(*devices: DevicePlugin) -> Callable[[], list[DevicePlugin]]:
    def tessellm_devices() -> list[DevicePlugin]:
        return list(devices)
    return tessellm_devices


def _raise(exc: Exception) -> Callable[[], Any]:
    def hook() -> Any:
        raise exc
    return hook


def _returning(value: Any) -> Callable[[], Any]:
    def hook() -> Any:
        return value
    return hook


future_api = _plugin("2.0", tessellm_devices=_devices(FakeDevice("future")))
no_api = _plugin(None, tessellm_devices=_devices(FakeDevice("undeclared")))
minor_newer = _plugin("1.10", tessellm_devices=_devices(FakeDevice("minor")))
minor_older = _plugin("1.0", tessellm_devices=_devices(FakeDevice("older")))


class AsyncFakeDevice(FakeDevice):
    asynchronous = True   # a DevicePlugin member of API 1.4


class OverridesFakeDevice(FakeDevice):
    def kernels_not_offered(self) -> dict[str, str]:   # 1.2
        return {}

    def communicator(self, rank: int, world_size: int, timeout_s: float) -> None:   # 1.3
        return None


# declared minor versions older than what they implement (refused), and the same, declared right
async_at_1_1 = _plugin("1.1", tessellm_devices=_devices(AsyncFakeDevice("async11")))
async_at_1_4 = _plugin("1.4", tessellm_devices=_devices(AsyncFakeDevice("async14")))
members_at_1_2 = _plugin("1.2", tessellm_devices=_devices(OverridesFakeDevice("members12")))
formats_at_1_4 = _plugin("1.4", tessellm_tool_call_formats=_returning([]))
overrides_at_1_2 = _plugin("1.2", tessellm_architectures=_returning({}))
overrides_at_1_2.TESSELLM_OVERRIDE_ARCHITECTURES = ()

fast = _plugin(tessellm_devices=_devices(FakeDevice("fast", priority=100)))
slow = _plugin(tessellm_devices=_devices(FakeDevice("slow", priority=5)))
best_but_absent = _plugin(tessellm_devices=_devices(
    FakeDevice("best", priority=1000, available=False, reason="no best-accelerator found on the PCI bus")))
flaky_probe = _plugin(tessellm_devices=_devices(
    FakeDevice("flaky", probe_error=RuntimeError("driver exploded"))))
kernels_missing = _plugin(tessellm_devices=_devices(
    FakeDevice("nokern", priority=500, kernels_error=ImportError("No module named 'fancy_kernels'"))))
duplicate_fast = _plugin(tessellm_devices=_devices(FakeDevice("fast", priority=1)))
devices_hook_raises = _plugin(tessellm_devices=_raise(ValueError("cannot enumerate devices")))
typo_hook = _plugin(tessellm_devicez=_devices(FakeDevice("typo")))

extra_kernels = _plugin(tessellm_kernels=_returning([
    Kernel("add", "extra_add", torch.add, "fast"),
    Kernel("add", "tpu_add", torch.add, "tpu9000"),
]))
kernels_hook_raises = _plugin(tessellm_kernels=_raise(RuntimeError("kernel build failed")))

def _arch(build_graph: Callable[..., Any] = build_llama_graph) -> Architecture:
    """A Llama-style architecture made from the public API alone."""
    return Architecture(llama_family_spec, adapt_llama_weights, build_graph)


def _identity_pass(mg: ModelGraph) -> ModelGraph:
    return mg


ARCH_A, ARCH_B, ARCH_O = _arch(), _arch(), _arch()
PASS_A = GraphPass("pass_a", _identity_pass)
PASS_B = GraphPass("pass_b", _identity_pass, ("linear",))

archs_a = _plugin(tessellm_architectures=_returning({"ToyForCausalLM": ARCH_A}),
                  tessellm_graph_passes=_returning([PASS_A]))
archs_b = _plugin(tessellm_architectures=_returning({"ToyForCausalLM": ARCH_B, "OtherLM": ARCH_O}),
                  tessellm_graph_passes=_returning([PASS_B]))
not_typed = _plugin(tessellm_architectures=_returning({"StrLM": "builder"}),
                    tessellm_graph_passes=_returning(["pass_as_a_string"]))
takes_llama = _plugin(tessellm_architectures=_returning({"LlamaForCausalLM": ARCH_A,
                                                         "MyLM": ARCH_O}),
                      tessellm_graph_passes=_returning([GraphPass("fuse_qkv", _identity_pass),
                                                        GraphPass("pass_a", _identity_pass)]))
overrides_llama = _plugin("1.3", tessellm_architectures=_returning({"LlamaForCausalLM": ARCH_B}))
overrides_llama.TESSELLM_OVERRIDE_ARCHITECTURES = ("LlamaForCausalLM",)
bad_override_decl = _plugin("1.3", tessellm_architectures=_returning({"LlamaForCausalLM": ARCH_B}))
bad_override_decl.TESSELLM_OVERRIDE_ARCHITECTURES = "LlamaForCausalLM"
overrides_cpu_kernel = _plugin(tessellm_kernels=_returning([
    Kernel("add", "fast_add", torch.add, "fast"),
    Kernel("add", "own_add", torch.add, "fast"),
]))


# tool-call formats: one named like a built-in (refused), one without the format methods
takes_hermes = _plugin("1.5", tessellm_tool_call_formats=_returning([
    SimpleNamespace(name="hermes", stream=print, parse_calls=print, matches_template=print,
                    grammar=print)]))
not_a_format = _plugin("1.5", tessellm_tool_call_formats=_returning([SimpleNamespace(name="half")]))


# speculative proposers: one named like a built-in (refused), one not callable (ignored), and
# a name an earlier plugin took (refused)
def _proposer_factory(config, parts):
    return SimpleNamespace(method="mine", propose=lambda requests, ks: [[] for _ in requests],
                           release=lambda request: None)


def _other_factory(config, parts):
    return _proposer_factory(config, parts)


proposers_a = _plugin("1.8", tessellm_speculative_proposers=_returning({
    "ngram": _proposer_factory, "mine": _proposer_factory, "broken": "not a factory"}))
proposers_b = _plugin("1.8", tessellm_speculative_proposers=_returning({
    "mine": _other_factory, "other": _other_factory}))
