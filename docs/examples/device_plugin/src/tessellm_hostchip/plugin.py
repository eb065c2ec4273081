"""Entry point module: the plugin API version it was written for, and its one hook."""
from __future__ import annotations

from tessellm.plugin_api import DevicePlugin, hookimpl

from tessellm_hostchip.device import HostChip

TESSELLM_API_VERSION = "1.3"


@hookimpl
def tessellm_devices() -> list[DevicePlugin]:
    return [HostChip()]
