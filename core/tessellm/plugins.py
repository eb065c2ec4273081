"""The plugin manager: finds plugins through entry points, checks their API version, probes
their devices loudly and merges what their hooks contribute.

Nothing a plugin does wrong is swallowed. Every entry point found yields one PluginRecord:
  loaded  -- imported, API version accepted, registered with pluggy, devices probed;
  refused -- imported, but its TESSELLM_API_VERSION is missing, of another major version,
             newer than the core's, or older than what its hooks, module attributes or
             devices' members need (plugin_versions; not registered: none of its hooks run);
  error   -- importing it, registering it or calling its `tessellm_devices` hook failed, or it
             provides a device name another plugin already provides (not registered).
A loaded plugin may still carry an `error` (a kernel for an unknown device, a failing
`tessellm_kernels` hook, ...): it stays loaded and the message says what was ignored.
Errors read "ExcType: message". Devices keep their probe result in a DeviceRecord; a device
whose `is_available()` or `kernels()` raises is unavailable with that error as the reason.
An available device may still leave out kernels it has but cannot run here (a native kernel
that failed to build): a device that defines `kernels_not_offered()` (kernel name -> reason,
read after `kernels()`) has them recorded on its DeviceRecord and shown by `tessellm plugins`.

Ordering: plugins are handled in entry-point order; a device's own kernels are registered before
kernels other plugins add through `tessellm_kernels` (KernelRegistry keeps that order).

Names are never taken over silently; each refusal is an error on the later plugin's record:
  kernels       -- a (device, op, name) already registered (by the device or an earlier plugin);
  architectures -- a built-in architecture name, unless the plugin lists it in
                   `TESSELLM_OVERRIDE_ARCHITECTURES` (then the record's `overrides` names it),
                   or a name an earlier plugin provides; values must be `Architecture`s;
  graph passes  -- a built-in pass name or one an earlier plugin provides; values must be
                   `GraphPass`es.
"""
from __future__ import annotations

import importlib.metadata
from typing import Any, Callable, Iterable

import pluggy

from tessellm.device import DevicePlugin
from tessellm.errors import ConfigError, DeviceUnavailableError, KernelError
from tessellm.graph.passes import GraphPass, default_passes
from tessellm.kernels.registry import Kernel, KernelRegistry
from tessellm.models.architectures import Architecture, builtin_architecture_names
from tessellm.quant.formats import QUANTIZABLE
from tessellm.plugin_records import DeviceRecord, PluginRecord, describe_exception, plugin_row
from tessellm.plugin_spec import ENTRY_POINT_GROUP, PROJECT, TessellmHookSpecs
from tessellm.plugin_versions import check_declared, check_needs, device_needs, module_needs

OVERRIDES_ATTR = "TESSELLM_OVERRIDE_ARCHITECTURES"


TOOL_FORMAT_METHODS = ("stream", "parse_calls", "matches_template", "grammar")


def builtin_pass_names() -> frozenset[str]:
    """Names of the passes tessellm itself may run (fusions, quantize_<format>, dead code)."""
    return frozenset({p.name for p in default_passes()}
                     | {f"quantize_{f.name.lower()}" for f in QUANTIZABLE})


def _dist_version(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    version = getattr(dist, "version", None) if dist is not None else None
    return str(version) if version else "unknown"


class PluginManager:
    """Discovers and holds the tessellm plugins. `load()` before anything else (the query
    methods call it). Results are computed once: the kernel registry, architectures and graph
    passes are cached, so each plugin error is recorded exactly once."""

    def __init__(self, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> None:
        self._entry_points = list(entry_points) if entry_points is not None else None
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(TessellmHookSpecs)
        self.records: list[PluginRecord] = []
        self._devices: dict[str, tuple[DevicePlugin, DeviceRecord]] = {}
        self._loaded = False
        self._registry: KernelRegistry | None = None
        self._kernel_owner: dict[tuple[str, str, str], str] = {}   # (device, op, name) -> plugin
        self._architectures: dict[str, Any] | None = None
        self._graph_passes: list[Any] | None = None
        self._tool_formats: list[Any] | None = None
        self._proposers: dict[str, Any] | None = None

    # -- loading -------------------------------------------------------------------------

    def load(self) -> "PluginManager":
        if self._loaded:
            return self
        self._loaded = True
        eps = self._entry_points
        if eps is None:
            eps = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        for ep in eps:
            self.records.append(self._load_one(ep))
        return self

    def _load_one(self, ep: importlib.metadata.EntryPoint) -> PluginRecord:
        record = PluginRecord(ep.name, ep.value, _dist_version(ep), "error")
        try:
            plugin = ep.load()
        except (Exception, SystemExit) as exc:  # a plugin's sys.exit() must not end the host
            record.error = describe_exception(exc)
            return record
        refusal = check_declared(plugin)
        if refusal is not None:
            record.status, record.error = "refused", refusal
            return record
        try:
            self._pm.register(plugin, name=ep.name)
        except Exception as exc:
            record.error = describe_exception(exc)
            return record
        hooks = [c.name for c in self._pm.get_hookcallers(plugin) or []]
        refusal = check_needs(plugin, module_needs(plugin, hooks))
        if refusal is not None:
            self._pm.unregister(plugin)
            record.status, record.error = "refused", refusal
            return record
        problem = self._unknown_hooks(plugin) or self._add_devices(plugin, record)
        if problem is not None:
            self._pm.unregister(plugin)
            record.devices = []
            record.error = problem
            return record
        record.status = "loaded"
        return record

    def _unknown_hooks(self, plugin: object) -> str | None:
        unknown = sorted(c.name for c in self._pm.get_hookcallers(plugin) or [] if not c.has_spec())
        if unknown:
            return f"PluginError: unknown hook(s) {', '.join(unknown)} (not in the tessellm hook specifications)"
        return None

    def _add_devices(self, plugin: object, record: PluginRecord) -> str | None:
        """Calls the plugin's `tessellm_devices`, probes each device; all or nothing. A device
        member newer than the plugin's declared API version marks the record refused."""
        devices: list[DevicePlugin] = []
        for call in self._impls(plugin, "tessellm_devices"):
            try:
                result = call()
            except Exception as exc:
                return f"tessellm_devices failed: {describe_exception(exc)}"
            if not isinstance(result, (list, tuple)):
                return f"PluginError: tessellm_devices returned {type(result).__name__}, not a list"
            devices.extend(result)
        names: set[str] = set()
        for dev in devices:
            name = getattr(dev, "name", None)
            if not isinstance(dev, DevicePlugin) or not isinstance(name, str) or not name:
                return f"PluginError: tessellm_devices returned {dev!r}, not a named DevicePlugin"
            if name in self._devices:
                owner = self._devices[name][1].plugin
                return f"PluginError: device {name!r} is already provided by plugin {owner!r}"
            if name in names:
                return f"PluginError: device {name!r} is provided twice"
            names.add(name)
        needs = {what: v for dev in devices for what, v in device_needs(dev).items()}
        refusal = check_needs(plugin, needs)
        if refusal is not None:
            record.status = "refused"
            return refusal
        for dev in devices:
            rec = DeviceRecord(dev.name, record.name, int(dev.priority), *_probe(dev),
                               distributed_backend=str(dev.distributed_backend))
            record.devices.append(rec)
            self._devices[dev.name] = (dev, rec)
        return None

    def _impls(self, plugin: object, hook_name: str) -> list[Callable[[], Any]]:
        caller = getattr(self._pm.hook, hook_name)
        return [impl.function for impl in caller.get_hookimpls() if impl.plugin is plugin]

    def _loaded_plugins(self) -> list[tuple[PluginRecord, object]]:
        out = []
        for record in self.records:
            if record.status == "loaded":
                out.append((record, self._pm.get_plugin(record.name)))
        return out

    # -- devices -------------------------------------------------------------------------

    def devices(self) -> dict[str, DevicePlugin]:
        """Devices of loaded plugins, available or not, in discovery order."""
        self.load()
        return {name: dev for name, (dev, _) in self._devices.items()}

    def device_records(self) -> list[DeviceRecord]:
        self.load()
        return [rec for _, rec in self._devices.values()]

    def select_device(self, name: str) -> DevicePlugin:
        """The device called `name`, or for "auto" the available one of highest priority
        (ties: the alphabetically first name). Availability includes whether the device's
        kernels import, so the kernel registry is built first."""
        self.kernel_registry()
        if name == "auto":
            ready = [(dev, rec) for dev, rec in self._devices.values() if rec.available]
            if not ready:
                raise DeviceUnavailableError(f"no available device for device='auto'; {self._summary()}")
            return min(ready, key=lambda dr: (-dr[1].priority, dr[1].name))[0]
        if name not in self._devices:
            raise ConfigError(f"unknown device {name!r}; {self._summary()}")
        dev, rec = self._devices[name]
        if not rec.available:
            raise DeviceUnavailableError(
                f"device {name!r} (plugin {rec.plugin!r}) is not available: {rec.reason}")
        return dev

    def _summary(self) -> str:
        devs = [f"{r.name} ({'available' if r.available else 'unavailable: ' + r.reason})"
                for _, r in self._devices.values()]
        text = "known devices: " + (", ".join(devs) if devs else "none")
        failed = [f"{r.name} [{r.status}] {r.error}" for r in self.records if r.status != "loaded"]
        if failed:
            text += "; plugins that failed: " + "; ".join(failed)
        return text

    # -- contributions -------------------------------------------------------------------

    def kernel_registry(self) -> KernelRegistry:
        """Every device's own kernels, then every loaded plugin's `tessellm_kernels`."""
        self.load()
        if self._registry is not None:
            return self._registry
        registry = KernelRegistry()
        owner = {rec.name: rec for rec in self.records}
        for dev, rec in self._devices.values():
            try:
                kernels = list(dev.kernels())
            except Exception as exc:
                why = f"kernels() failed: {describe_exception(exc)}"
                rec.reason = why if rec.available else f"{rec.reason}; {why}"
                rec.available = False
                continue
            rec.not_offered = _not_offered(dev, owner[rec.plugin])
            for kernel in kernels:
                self._register(registry, kernel, owner[rec.plugin], expect_device=dev.name)
        for record, plugin in self._loaded_plugins():
            for call in self._impls(plugin, "tessellm_kernels"):
                try:
                    kernels = list(call())
                except Exception as exc:
                    record.add_error(f"tessellm_kernels failed: {describe_exception(exc)}")
                    continue
                for kernel in kernels:
                    self._register(registry, kernel, record, expect_device=None)
        self._registry = registry
        return registry

    def _register(self, registry: KernelRegistry, kernel: object, record: PluginRecord,
                  expect_device: str | None) -> None:
        if not isinstance(kernel, Kernel):
            record.add_error(f"PluginError: {kernel!r} is not a Kernel (ignored)")
            return
        if expect_device is not None and kernel.device != expect_device:
            record.add_error(f"PluginError: device {expect_device!r} offers kernel {kernel.name!r} "
                             f"for another device {kernel.device!r} (ignored)")
            return
        if kernel.device not in self._devices:
            record.add_error(
                f"PluginError: kernel {kernel.name!r} for op {kernel.op!r} names unknown device "
                f"{kernel.device!r} (known: {', '.join(self._devices) or 'none'}; ignored)")
            return
        key = (kernel.device, kernel.op, kernel.name)
        if key in self._kernel_owner:
            record.add_error(
                f"PluginError: kernel {kernel.name!r} for op {kernel.op!r} on device "
                f"{kernel.device!r} would override the one plugin {self._kernel_owner[key]!r} "
                "registered (refused; register it under a name of its own)")
            return
        try:
            registry.register(kernel)
        except KernelError as exc:
            record.add_error(f"{describe_exception(exc)} (ignored)")
            return
        self._kernel_owner[key] = record.name

    def architectures(self) -> dict[str, Architecture]:
        """HF architecture name -> Architecture from the plugins (see the module docstring for
        what is refused); a built-in name is here only when its plugin declared the override."""
        self.load()
        if self._architectures is None:
            builtin = builtin_architecture_names()
            merged: dict[str, Architecture] = {}
            source: dict[str, str] = {}
            for record, result in self._hook_results("tessellm_architectures", dict):
                allowed = self._declared_overrides(record)
                for arch, value in result.items():
                    if not isinstance(value, Architecture):
                        record.add_error(f"PluginError: architecture {arch!r} is "
                                         f"{type(value).__name__}, not an Architecture (ignored)")
                    elif arch in merged:
                        record.add_error(f"PluginError: architecture {arch!r} is already provided "
                                         f"by plugin {source[arch]!r} (refused)")
                    elif arch in builtin and arch not in allowed:
                        record.add_error(
                            f"PluginError: architecture {arch!r} would override tessellm's "
                            f"built-in one (refused; declare {OVERRIDES_ATTR} = ({arch!r},) "
                            "to replace it)")
                    else:
                        if arch in builtin:
                            record.overrides.append(f"architecture {arch}")
                        merged[arch], source[arch] = value, record.name
            self._architectures = merged
        return dict(self._architectures)

    def _declared_overrides(self, record: PluginRecord) -> frozenset[str]:
        declared = getattr(self._pm.get_plugin(record.name), OVERRIDES_ATTR, ())
        if not isinstance(declared, (tuple, list, set, frozenset)) or \
                not all(isinstance(n, str) for n in declared):
            record.add_error(f"PluginError: {OVERRIDES_ATTR} = {declared!r} is not a tuple of "
                             "architecture names (ignored)")
            return frozenset()
        return frozenset(declared)

    def graph_passes(self) -> list[GraphPass]:
        """The plugins' GraphPasses in plugin order (see the module docstring for refusals)."""
        self.load()
        if self._graph_passes is None:
            self._graph_passes = [p for _, p in self._unique_named(
                "tessellm_graph_passes", (list, tuple), "graph pass", builtin_pass_names(),
                lambda result: ((getattr(p, "name", None), p) for p in result),
                lambda name, p: None if isinstance(p, GraphPass)
                else f"graph pass {p!r} is not a GraphPass")]
        return list(self._graph_passes)

    def tool_call_formats(self) -> list[Any]:
        """The plugins' tool-call formats in plugin order; one named like a built-in or an
        earlier plugin's format, or lacking the format methods, is refused on its record."""
        from tessellm.tools.formats import BUILTIN_FORMATS
        self.load()
        if self._tool_formats is None:
            def invalid(name: Any, f: Any) -> str | None:
                missing = [m for m in TOOL_FORMAT_METHODS if not callable(getattr(f, m, None))]
                if isinstance(name, str) and not missing:
                    return None
                return f"tool-call format {f!r} lacks {', '.join(missing) or 'a name'}"
            self._tool_formats = [f for _, f in self._unique_named(
                "tessellm_tool_call_formats", (list, tuple), "tool-call format",
                [f.name for f in BUILTIN_FORMATS],
                lambda result: ((getattr(f, "name", None), f) for f in result), invalid)]
        return list(self._tool_formats)

    def speculative_proposers(self) -> dict[str, Any]:
        """The plugins' speculative proposers (method name -> factory(config, engine parts)),
        in plugin order; a name of a built-in method or an earlier plugin's, or a factory
        that is not callable, is refused on its record."""
        from tessellm.speculative.proposer import builtin_proposers
        self.load()
        if self._proposers is None:
            self._proposers = dict(self._unique_named(
                "tessellm_speculative_proposers", dict, "speculative proposer",
                builtin_proposers(), lambda result: result.items(),
                lambda name, factory: None if isinstance(name, str) and name
                and callable(factory) else f"speculative proposer {name!r}: {factory!r} is "
                "not a callable factory"))
        return dict(self._proposers)

    def _unique_named(self, hook_name: str, kind: type | tuple[type, ...], what: str,
                      builtin: Any, entries: Any, invalid: Any) -> list[tuple[Any, Any]]:
        """(name, value) of every plugin's `hook_name` results, in plugin order:
        `entries(result)` yields them; `invalid(name, value)` says why one is ignored (None: it is
        fine); a name of a built-in (`builtin`) or of an earlier plugin's is refused. Each
        refusal is an error on the plugin's record."""
        taken = dict.fromkeys(builtin, "tessellm")
        values: list[tuple[Any, Any]] = []
        for record, result in self._hook_results(hook_name, kind):
            for name, value in entries(result):
                why = invalid(name, value)
                if why is not None:
                    record.add_error(f"PluginError: {why} (ignored)")
                elif name in taken:
                    record.add_error(f"PluginError: {what} {name!r} would override the one of "
                                     f"{taken[name]!r} (refused)")
                else:
                    taken[name] = record.name
                    values.append((name, value))
        return values

    def _hook_results(self, hook_name: str, kind: type | tuple[type, ...]) -> list[tuple[PluginRecord, Any]]:
        out = []
        for record, plugin in self._loaded_plugins():
            for call in self._impls(plugin, hook_name):
                try:
                    result = call()
                except Exception as exc:
                    record.add_error(f"{hook_name} failed: {describe_exception(exc)}")
                    continue
                if not isinstance(result, kind):
                    record.add_error(f"PluginError: {hook_name} returned {type(result).__name__} (ignored)")
                    continue
                out.append((record, result))
        return out

    # -- reporting -----------------------------------------------------------------------

    def report(self) -> list[dict[str, Any]]:
        """One JSON-able row per plugin found (`tessellm plugins --json`). Collects kernels,
        architectures and graph passes first, so that their errors show too."""
        self.kernel_registry()
        self.architectures()
        self.graph_passes()
        self.tool_call_formats()
        self.speculative_proposers()
        return [plugin_row(r) for r in self.records]


def _not_offered(dev: DevicePlugin, record: PluginRecord) -> dict[str, str]:
    """The device's `kernels_not_offered()` (optional), checked; a failure of it is an error
    on the plugin's record, never a reason to drop the device."""
    hook = getattr(dev, "kernels_not_offered", None)
    if hook is None:
        return {}
    try:
        result = hook()
        return {str(name): str(why) for name, why in dict(result).items()}
    except Exception as exc:
        record.add_error(f"device {dev.name!r}: kernels_not_offered() failed: "
                         f"{describe_exception(exc)} (ignored)")
        return {}


def _probe(dev: DevicePlugin) -> tuple[bool, str]:
    try:
        availability = dev.is_available()
        return bool(availability.available), str(availability.reason)
    except Exception as exc:
        return False, f"is_available() failed: {describe_exception(exc)}"
