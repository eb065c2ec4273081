"""The public plugin API: the one module a plugin package imports (versioned by API_VERSION).

It re-exports the device contract, kernel registration types, the reference ops and the hook
marker. Plugins must not import engine or scheduler internals.
"""
from tessellm.device import (
    AllocatorStats,
    Availability,
    CompletedEvent,
    DecodeGraphShape,
    StaticShapes,
    StaticStepShape,
    DeviceAllocator,
    DevicePlugin,
    Event,
    HostAllocator,
    MemoryInfo,
    SynchronousStream,
    TransferStream,
    host_memory_info,
)
from tessellm.kernels import portable, reference
from tessellm.kernels.attention_metadata import AttentionMetadata
from tessellm.kernels.registry import Kernel, KernelQuery, WeightLayout
from tessellm.paths import cache_root
from tessellm.quant.formats import PackedFormat, PackedWeight, dequantize, quantize
from tessellm.plugin_spec import API_VERSION, hookimpl

__all__ = [
    "API_VERSION", "AllocatorStats", "AttentionMetadata", "Availability", "CompletedEvent",
    "DecodeGraphShape", "StaticShapes", "StaticStepShape",
    "DeviceAllocator", "DevicePlugin", "Event", "HostAllocator", "Kernel", "KernelQuery",
    "MemoryInfo", "PackedFormat", "PackedWeight", "SynchronousStream", "TransferStream",
    "WeightLayout", "cache_root", "dequantize", "host_memory_info", "hookimpl", "quantize", "portable", "reference",
]
