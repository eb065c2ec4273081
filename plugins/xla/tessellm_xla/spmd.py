"""The SPMD seam for tensor parallelism on XLA: a device mesh and sharding annotations, so that
parallelism is XLA's partitioner inserting collectives, not one process per device.

Rules (Megatron's): column-parallel (output features split: weight rows) for the fused q/k/v
and gate/up projections, row-parallel (input features split: weight columns) for the output
and down projections; everything else (norms, embedding, LM head, rotary tables) replicated.
An annotation changes only where data lives, never the result. `use_spmd` must come before the
process creates any XLA tensor (torch_xla's rule), so `tensor_parallel_mesh` is called first.
"""
from __future__ import annotations

from typing import Any

COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj", "q_proj", "k_proj", "v_proj", "gate_proj",
                   "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def tensor_parallel_mesh(num_devices: int | None = None, axis: str = "tp") -> Any:
    """A 1-D mesh over `num_devices` (default: every device of the runtime), SPMD on."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    xr.use_spmd()
    n = num_devices or xr.global_runtime_device_count()
    return xs.Mesh(np.arange(n), (n,), (axis,))


def partition_spec(name: str, shape: tuple[int, ...], axis: str = "tp"
                   ) -> tuple[str | None, ...] | None:
    """The sharding of weight `name` ([out, in] for linears): None means replicated."""
    if len(shape) != 2:
        return None
    parts = name.split(".")
    if any(p in COLUMN_PARALLEL for p in parts):
        return (axis, None)
    if any(p in ROW_PARALLEL for p in parts):
        return (None, axis)
    return None


def annotate_tensor_parallel(weights: dict[str, Any], mesh: Any, axis: str = "tp"
                             ) -> dict[str, tuple[str | None, ...]]:
    """Mark every linear weight's sharding over `mesh` (in place); returns name -> spec.
    A dimension the mesh does not divide is an error naming the weight."""
    import torch_xla.distributed.spmd as xs
    size = mesh.shape()[axis]
    applied = {}
    for name, w in weights.items():
        spec = partition_spec(name, tuple(w.shape), axis)
        if spec is None:
            continue
        dim = spec.index(axis)
        if w.shape[dim] % size:
            raise ValueError(f"{name}: dimension {dim} of shape {tuple(w.shape)} does not "
                             f"split over {size} devices")
        xs.mark_sharding(w, mesh, spec)
        applied[name] = spec
    return applied
