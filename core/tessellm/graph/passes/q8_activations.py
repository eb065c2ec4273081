"""Int8 activations for packed weights (opt-in: EngineConfig.packed_activations = "q8_0"):
every linear_packed becomes a linear_packed_q8act, which rounds each 32-value block of its
input to int8 before the product (llama.cpp's way of running a quantized model; the device's
kernel may then use integer dot products), and, as a pass of its own (a device may have the
linear without the experts op), every fused_moe_packed a fused_moe_packed_q8act, whose
expert linears round their inputs the same way. They change the numbers, so they are never
implied by anything else. Run after the fusion and weight-quantization passes."""
from __future__ import annotations

from tessellm.graph import ops
from tessellm.graph.ir import ModelGraph


def q8_activations(mg: ModelGraph) -> ModelGraph:
    for node in mg.op_nodes(ops.linear_packed):
        node.target = ops.linear_packed_q8act
    return mg


def q8_activations_experts(mg: ModelGraph) -> ModelGraph:
    for node in mg.op_nodes(ops.fused_moe_packed):
        node.target = ops.fused_moe_packed_q8act
    return mg
