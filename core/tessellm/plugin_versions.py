"""The plugin API version a plugin declares, checked against the core and against what the
plugin implements.

A plugin module declares `TESSELLM_API_VERSION = "<major>.<minor>"`. It is accepted when:
- its major version is the core's (API_VERSION) — another major is refused;
- its minor version is no newer than the core's — a plugin written for a newer core may rely
  on what this one lacks, so it is refused, naming both versions;
- its minor version is at least the one that added each versioned thing it implements (the
  tables below: a hook, a module attribute, a DevicePlugin member its own classes define) — a
  plugin declaring 1.1 while implementing a 1.4 member would load on a 1.1-1.3 core that
  ignores that member, so it is refused, naming what needs which version.
Kernel ops are not checked: plugins commonly register a kernel per op the core lists
(plugin_api.reference.REFERENCE_OPS), so a kernel for a newer op comes from the core itself.
Every check returns the reason as a sentence, or None; nothing here raises or keeps state.
"""
from __future__ import annotations

from tessellm.device import DevicePlugin
from tessellm.plugin_spec import API_VERSION

Version = tuple[int, int]

# What each minor version added that a plugin implements (see plugin_spec's history); what
# every version since 1.0 has (tessellm_devices, tessellm_kernels, compile, ...) is not listed.
HOOKS_SINCE: dict[str, Version] = {"tessellm_tool_call_formats": (1, 5),
                                   "tessellm_speculative_proposers": (1, 8)}
MODULE_ATTRIBUTES_SINCE: dict[str, Version] = {"TESSELLM_OVERRIDE_ARCHITECTURES": (1, 3)}
DEVICE_MEMBERS_SINCE: dict[str, Version] = {
    "decode_graph_sizes": (1, 2), "static_shapes": (1, 2), "kv_cache_budget": (1, 2),
    "kernels_not_offered": (1, 2), "runtime_counters": (1, 2), "communicator": (1, 3),
    "asynchronous": (1, 4), "prefers_int8_activations": (1, 9),
}


def parse_version(text: object) -> Version | None:
    """(major, minor) of a "<major>.<minor>" string, None for anything else."""
    if not isinstance(text, str):
        return None
    parts = text.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


CORE_VERSION: Version = parse_version(API_VERSION) or (0, 0)


def _text(version: Version) -> str:
    return f"{version[0]}.{version[1]}"


def check_declared(module: object) -> str | None:
    """Why the plugin `module` is refused for the version it declares, or None."""
    declared = getattr(module, "TESSELLM_API_VERSION", None)
    supported = (f"this tessellm core supports plugin API version {API_VERSION} "
                 f"(major {CORE_VERSION[0]})")
    if declared is None:
        return f"the plugin declares no TESSELLM_API_VERSION; {supported}"
    version = parse_version(declared)
    if version is None:
        return (f"the plugin declares TESSELLM_API_VERSION = {declared!r}, not "
                f"'<major>.<minor>'; {supported}")
    if version[0] != CORE_VERSION[0]:
        return f"the plugin declares API version {declared}; {supported}"
    if version > CORE_VERSION:
        return (f"the plugin declares API version {declared}, newer than this core's {API_VERSION} "
                "(it may use what this core lacks): upgrade tessellm")
    return None


def module_needs(module: object, hook_names: list[str]) -> dict[str, Version]:
    """What the plugin module itself implements that a minor version added: its hooks
    (`hook_names`, those it implements) and module attributes, description -> version."""
    needs = {f"hook {h}": HOOKS_SINCE[h] for h in hook_names if h in HOOKS_SINCE}
    needs.update({f"{a}": v for a, v in MODULE_ATTRIBUTES_SINCE.items() if hasattr(module, a)})
    return needs


# Packages that ship with the core (its built-in device plugins): their classes are at the
# core's version, so a plugin subclassing one (CpuDevice) does not implement what it inherits.
CORE_PACKAGES = frozenset({"tessellm", "tessellm_cpu", "tessellm_cuda", "tessellm_xla"})


def _plugin_defines(device: DevicePlugin, member: str) -> bool:
    """Whether the device's own classes (not tessellm's nor its built-in plugins') or the
    instance define `member`."""
    if member in getattr(device, "__dict__", {}):
        return True
    for cls in type(device).__mro__:
        if cls.__module__.split(".")[0] in CORE_PACKAGES:
            continue
        if member in vars(cls):
            return True
    return False


def device_needs(device: DevicePlugin) -> dict[str, Version]:
    """The DevicePlugin members a minor version added that the device defines."""
    return {f"DevicePlugin.{m} (device {device.name!r})": v
            for m, v in DEVICE_MEMBERS_SINCE.items() if _plugin_defines(device, m)}


def check_needs(module: object, needs: dict[str, Version]) -> str | None:
    """Why `needs` exceed the minor version the plugin declares (already accepted by
    check_declared), naming each thing and its version, or None."""
    declared = parse_version(getattr(module, "TESSELLM_API_VERSION", None))
    if declared is None:
        return None
    newer = {what: v for what, v in needs.items() if v > declared}
    if not newer:
        return None
    listed = ", ".join(f"{what} (added in {_text(v)})" for what, v in sorted(newer.items()))
    return (f"the plugin declares API version {_text(declared)} but implements {listed}; "
            f"declare TESSELLM_API_VERSION = \"{_text(max(newer.values()))}\" or later "
            f"(this core supports {API_VERSION})")
