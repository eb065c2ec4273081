"""What the plugin manager keeps of each entry point and each device it probed, and their
JSON rows (`tessellm plugins --json`): a PluginRecord per entry point (loaded / refused /
error, with every error message joined), a DeviceRecord per device (its probe result,
distributed backend and the kernels it does not offer here)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

PluginStatus = Literal["loaded", "error", "refused"]


@dataclass(slots=True)
class DeviceRecord:
    name: str
    plugin: str
    priority: int
    available: bool
    reason: str
    distributed_backend: str = "gloo"   # tensor parallelism's collectives (torch.distributed)
    # kernels the device has but does not offer here, name -> reason (kernels_not_offered())
    not_offered: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class PluginRecord:
    """One entry point found. `error` is None only when nothing about the plugin failed."""

    name: str
    value: str
    version: str
    status: PluginStatus
    error: str | None = None
    devices: list[DeviceRecord] = field(default_factory=list)
    # built-in names it replaces by its own declaration (TESSELLM_OVERRIDE_ARCHITECTURES)
    overrides: list[str] = field(default_factory=list)

    def add_error(self, message: str) -> None:
        self.error = message if self.error is None else f"{self.error}; {message}"


def describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"



def plugin_row(r: PluginRecord) -> dict[str, Any]:
    row: dict[str, Any] = {"plugin": r.name, "value": r.value, "version": r.version,
                           "status": r.status, "error": r.error,
                           "devices": [device_row(d) for d in r.devices]}
    if r.overrides:   # only where a plugin replaces a built-in, so the usual row stays as it was
        row["overrides"] = list(r.overrides)
    return row


def device_row(d: DeviceRecord) -> dict[str, Any]:
    row: dict[str, Any] = {"name": d.name, "priority": d.priority, "available": d.available,
                           "reason": d.reason, "distributed_backend": d.distributed_backend}
    if d.not_offered:   # only where some kernel is left out, so the usual row stays as it was
        row["kernels_not_offered"] = dict(d.not_offered)
    return row
