"""Entry point module of the XLA plugin: declares the API version and its device."""
from __future__ import annotations

from tessellm.plugin_api import DevicePlugin, hookimpl
from tessellm_xla.device import XlaDevice

TESSELLM_API_VERSION = "1.2"


@hookimpl
def tessellm_devices() -> list[DevicePlugin]:
    return [XlaDevice()]
