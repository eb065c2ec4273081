"""The conformance suite of one device: which checks run, in which order, and their results.

`plan_checks` lists the checks of a device (its availability first; when it is available,
memory info, allocator, upload, host allocator, streams and events, one check per kernel it
offers, then end to end: the built-in demo model always, a named model directory's reference
too). `run_checks` runs them in order: a check passes when it returns (its detail), fails when
it raises — CheckFailed carries the verdict, any other exception is a failure naming its type.
Nothing is skipped silently: only groups the user names in `skip` are skipped, each of their
checks listed as SKIP; an unavailable device yields its failed availability check alone, and
the report fails.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

from tessellm.device import DevicePlugin
from tessellm.errors import ConfigError
from tessellm.kernels.op_coverage import OPTIONAL_OPS, REQUIRED_OPS
from tessellm.kernels.reference import REFERENCE_OPS
from tessellm.plugins import PluginManager
from tessellm.testing import memory_checks as mem
from tessellm.testing import stream_checks as streams
from tessellm.testing.end_to_end import check_demo_greedy, check_stories_greedy, named_model_dir
from tessellm.testing.kernel_cases import Padding
from tessellm.testing.kernel_checks import CheckFailed, check_kernel
from tessellm.testing.results import CheckResult, ConformanceReport

GROUPS = ("availability", "memory", "allocator", "host_allocator", "streams", "kernels",
          "end_to_end")


SKIPPED = "skipped at the user's request"


@dataclass(slots=True, frozen=True)
class Check:
    name: str
    group: str
    run: Callable[[], str]
    skipped: bool = False      # the user opted out of its group: SKIP, not run

    def result(self) -> CheckResult:
        if self.skipped:
            return CheckResult(self.name, "SKIP", f"{SKIPPED} (skip {self.group})")
        try:
            return CheckResult(self.name, "PASS", self.run())
        except CheckFailed as exc:
            return CheckResult(self.name, "FAIL", str(exc))
        except Exception as exc:
            return CheckResult(self.name, "FAIL", f"raised {type(exc).__name__}: {exc}")


def device_padding(device: DevicePlugin) -> Padding:
    """The padded steps this device's engine sends its kernels."""
    return Padding(decode_graphs=bool(device.decode_graph_sizes(8)),
                   static_shapes=device.static_shapes(64, 8) is not None)


def _kernel_checks(manager: PluginManager, device: DevicePlugin) -> list[Check]:
    registry = manager.kernel_registry()
    ops = registry.ops(device.name)
    padding = device_padding(device)

    def known_ops() -> str:
        if not ops:
            raise CheckFailed("the device offers no kernels")
        unknown = sorted(set(ops) - set(REFERENCE_OPS))
        if unknown:
            raise CheckFailed(f"kernels for ops without a reference: {', '.join(unknown)}")
        missing = sorted(REQUIRED_OPS - set(ops))
        if missing:
            raise CheckFailed(f"no kernel for the required op(s) {', '.join(missing)} "
                              "(tessellm.plugin_api.REQUIRED_OPS): some models cannot run here")
        optional = sorted(OPTIONAL_OPS - set(ops))
        return (f"{len(ops)} ops: {', '.join(ops)}"
                + (f"; optional ops not covered: {', '.join(optional)}" if optional else ""))

    checks = [Check("kernels.ops", "kernels", known_ops)]
    for op in ops:
        if op not in REFERENCE_OPS:
            continue
        for kernel in registry.kernels(device.name, op):
            checks.append(Check(f"kernel:{op}/{kernel.name}", "kernels",
                                lambda k=kernel: check_kernel(k, device.torch_device_type,
                                                              padding)))
    return checks


def plan_checks(device_name: str, manager: PluginManager | None = None,
                model_dir: str | Path | None = None,
                groups: Iterable[str] | None = None,
                skip: Iterable[str] = ()) -> list[Check]:
    """The checks of `device_name` (ConfigError for a device no loaded plugin provides, or an
    unknown group). `groups` limits them to some of GROUPS (default: all); the checks of the
    groups in `skip` (availability cannot be skipped) are listed but not run."""
    manager = manager or PluginManager().load()
    chosen = set(GROUPS if groups is None else groups)
    skipped = set(skip)
    if (chosen | skipped) - set(GROUPS):
        unknown = sorted((chosen | skipped) - set(GROUPS))
        raise ConfigError(f"unknown conformance group(s) {unknown}; groups: {', '.join(GROUPS)}")
    if "availability" in skipped:
        raise ConfigError("the availability check cannot be skipped")
    manager.kernel_registry()          # availability includes whether kernels() works
    devices = manager.devices()
    if device_name not in devices:
        manager.select_device(device_name)     # raises ConfigError naming the known devices
    device = devices[device_name]
    record = next(r for r in manager.device_records() if r.name == device_name)

    def availability() -> str:
        if not record.available:   # includes a kernels() that raised
            raise CheckFailed(f"device is not available: {record.reason}")
        return mem.check_availability(device)

    checks = [Check("availability", "availability", availability)]
    if not record.available:
        return checks
    checks += [
        Check("memory_info", "memory", lambda: mem.check_memory_info(device)),
        Check("allocator.accounting", "allocator", lambda: mem.check_allocator_accounting(device)),
        Check("allocator.capacity", "allocator", lambda: mem.check_allocator_capacity(device)),
        Check("allocator.upload", "allocator", lambda: mem.check_upload(device)),
        Check("host_allocator", "host_allocator", lambda: mem.check_host_allocator(device)),
        Check("stream.copy_event", "streams", lambda: streams.check_copy_event(device)),
        Check("stream.record_event", "streams", lambda: streams.check_record_event(device)),
        Check("stream.query", "streams", lambda: streams.check_query(device)),
        Check("stream.synchronize", "streams", lambda: streams.check_synchronize(device)),
        Check("stream.wait_on_compute", "streams", lambda: streams.check_wait_on_compute(device)),
    ]
    checks += _kernel_checks(manager, device)
    checks.append(Check("end_to_end.demo", "end_to_end",
                        lambda: check_demo_greedy(manager, device_name)))
    if named_model_dir(model_dir) is not None:
        checks.append(Check("end_to_end.stories260K", "end_to_end",
                            lambda: check_stories_greedy(manager, device_name, model_dir)))
    return [replace(c, skipped=c.group in skipped) for c in checks
            if c.group in chosen or c.group == "availability"]


def run_checks(device_name: str, checks: Iterable[Check]) -> ConformanceReport:
    return ConformanceReport(device_name, [c.result() for c in checks])


def run_conformance(device_name: str, manager: PluginManager | None = None,
                    model_dir: str | Path | None = None,
                    groups: Iterable[str] | None = None,
                    skip: Iterable[str] = ()) -> ConformanceReport:
    """Plans and runs the suite of one device; `report.passed` is the verdict."""
    return run_checks(device_name, plan_checks(device_name, manager, model_dir, groups, skip))
