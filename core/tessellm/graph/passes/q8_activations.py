"""Int8 activations for packed linears (opt-in: EngineConfig.packed_activations = "q8_0"):
every linear_packed becomes a linear_packed_q8act, which rounds each 32-value block of its
input to int8 before the product (llama.cpp's way of running a quantized model; the device's
kernel may then use integer dot products). It changes the numbers, so it is never implied by
anything else. Runs after the fusion and weight-quantization passes."""
from __future__ import annotations

from tessellm.graph import ops
from tessellm.graph.ir import ModelGraph


def q8_activations(mg: ModelGraph) -> ModelGraph:
    for node in mg.op_nodes(ops.linear_packed):
        node.target = ops.linear_packed_q8act
    return mg
