"""The `hostchip` device: memory from an accounting allocator over host memory, transfers on a
worker thread, and a kernel for each op the Llama and GPT-2 graphs use: plugin_api's portable
kernels where it has one, the reference op elsewhere."""
from __future__ import annotations

import threading

from tessellm.plugin_api import (
    Availability,
    DeviceAllocator,
    DevicePlugin,
    Kernel,
    MemoryInfo,
    TransferStream,
    host_memory_info,
    portable,
    reference,
)

from tessellm_hostchip.stream import CopyWorker, ThreadStream

CAPACITY_BYTES = 2 << 30

# op -> the function that runs it on this device, with the op's reference signature. These are
# the ops of the built-in graphs (Llama, GPT-2, Gemma, mixtures of experts); ops a device lacks are either avoided (a fusion whose
# fused op has no kernel is not applied) or, for sample_tokens, run as the reference.
KERNELS = {
    "embedding": reference.embedding,
    "linear": reference.linear,
    "add": reference.add,
    "mul": reference.mul,
    "silu": reference.silu,
    "gelu_tanh": portable.gelu_tanh,
    "mul_scalar": portable.mul_scalar,
    "logit_softcap": portable.logit_softcap,
    "layer_norm": portable.layer_norm,
    "rms_norm": portable.rms_norm,
    "fused_add_rms_norm": portable.fused_add_rms_norm,
    "silu_and_mul": portable.silu_and_mul,
    "rotary_embedding": portable.rotary_embedding,
    "write_kv_cache": portable.write_kv_cache,
    "attention_prefill": portable.paged_attention_static,
    "attention_decode": portable.paged_attention_static,
    "moe_router": portable.moe_router,
    "fused_moe": portable.fused_moe_dense,
    "sigmoid_gate": portable.sigmoid_gate,
}


class HostChip(DevicePlugin):
    name = "hostchip"
    torch_device_type = "cpu"   # tensors live in host memory
    priority = -20              # `device: auto` prefers any real device
    version = "0.1.0"

    def __init__(self) -> None:
        self._allocator = DeviceAllocator("cpu", CAPACITY_BYTES)
        self._copies: CopyWorker | None = None   # started by the first stream asked for
        self._lock = threading.Lock()

    def is_available(self) -> Availability:
        return Availability(True)

    def memory_info(self) -> MemoryInfo:
        free = min(self._allocator.free_bytes, host_memory_info().free_bytes)
        return MemoryInfo(total_bytes=CAPACITY_BYTES, free_bytes=free)

    def synchronize(self) -> None:
        """Returns once every copy enqueued on any of this device's streams has landed."""
        if self._copies is not None:
            self._copies.enqueue(None, None).wait()

    def allocator(self) -> DeviceAllocator:
        return self._allocator

    def new_stream(self) -> TransferStream:
        with self._lock:
            if self._copies is None:
                self._copies = CopyWorker()
        return ThreadStream(self._copies)

    def kernels(self) -> list[Kernel]:
        return [Kernel(op, f"hostchip_{op}", fn, self.name) for op, fn in KERNELS.items()]
