"""Entry point module of the CPU plugin: declares the API version and its hooks."""
from __future__ import annotations

from tessellm.plugin_api import DevicePlugin, hookimpl
from tessellm_cpu.device import CpuDevice

TESSELLM_API_VERSION = "1.9"


@hookimpl
def tessellm_devices() -> list[DevicePlugin]:
    return [CpuDevice()]
