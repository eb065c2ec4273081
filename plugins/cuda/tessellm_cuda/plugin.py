"""Entry point module of the CUDA plugin: declares the API version and its devices."""
from __future__ import annotations

from tessellm.plugin_api import DevicePlugin, hookimpl
from tessellm_cuda.device import CudaDevice, TritonInterpretDevice

TESSELLM_API_VERSION = "1.6"


@hookimpl
def tessellm_devices() -> list[DevicePlugin]:
    return [CudaDevice(), TritonInterpretDevice()]
