"""Entry point module of the sim plugin: declares the plugin API version it was built for and
its hooks. Imports from tessellm only through tessellm.plugin_api."""
from __future__ import annotations

from tessellm.plugin_api import DevicePlugin, hookimpl

from tessellm_sim.device import SimDevice

TESSELLM_API_VERSION = "1.0"


@hookimpl
def tessellm_devices() -> list[DevicePlugin]:
    return [SimDevice()]
