"""The public plugin API: the one module a plugin package imports (versioned by API_VERSION).

It re-exports what every hook needs: the device contract (tessellm_devices), kernel
registration types, the reference and portable ops (tessellm_kernels), the architecture
record, model spec readers, graph builders and weight adapters (tessellm_architectures), the
graph IR, its op targets and the pass type (tessellm_graph_passes), and the hook marker.
Plugins must not import engine or scheduler internals.
"""
from tessellm.device import (
    AllocatorStats,
    Availability,
    CompletedEvent,
    Communicator,
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
    "API_VERSION", "AllocatorStats", "AttentionMetadata", "Availability", "Communicator",
    "CompletedEvent",
    "DecodeGraphShape", "StaticShapes", "StaticStepShape",
    "DeviceAllocator", "DevicePlugin", "Event", "HostAllocator", "Kernel", "KernelQuery",
    "MemoryInfo", "PackedFormat", "PackedWeight", "SynchronousStream", "TransferStream",
    "WeightLayout", "cache_root", "dequantize", "host_memory_info", "hookimpl", "quantize", "portable", "reference",
]

# -- architectures and graph passes (API 1.3) ---------------------------------------------------
from tessellm.graph import ops as graph_ops  # noqa: E402  (op targets: graph_ops.linear, ...)
from tessellm.graph.ir import (  # noqa: E402
    GraphBuilder,
    ModelGraph,
    StepPlaceholders,
    linear_call,
    linear_dims,
)
from tessellm.graph.passes import GraphPass  # noqa: E402
from tessellm.models.architectures import Architecture, builtin_architecture_names  # noqa: E402
from tessellm.models.gpt2 import adapt_gpt2_weights, build_gpt2_graph  # noqa: E402
from tessellm.models.llama import adapt_llama_weights, build_llama_graph  # noqa: E402
from tessellm.models.spec import ModelSpec, gpt2_spec, llama_family_spec  # noqa: E402

__all__ += [
    "Architecture", "GraphBuilder", "GraphPass", "ModelGraph", "ModelSpec", "StepPlaceholders",
    "adapt_gpt2_weights", "adapt_llama_weights", "build_gpt2_graph", "build_llama_graph",
    "builtin_architecture_names", "gpt2_spec", "graph_ops", "linear_call", "linear_dims",
    "llama_family_spec",
]

# 1.5: tool-call formats (the tessellm_tool_call_formats hook)
from tessellm.tools.call_format import (  # noqa: E402
    ArgumentsDelta,
    CallFormat,
    CallStarted,
    ContentDelta,
    ParsedOutput,
    ToolCall,
    ToolCallStream,
    ToolSpec,
)

__all__ += ["ArgumentsDelta", "CallFormat", "CallStarted", "ContentDelta", "ParsedOutput",
            "ToolCall", "ToolCallStream", "ToolSpec"]

# 1.6: the errors a plugin raises, the plan `compile` gets and its feeds, the ops to cover
from tessellm.errors import DeviceUnavailableError, KernelError  # noqa: E402
from tessellm.graph.plan import KV_CACHE_FEED, STEP_FEEDS, ExecutionPlan  # noqa: E402
from tessellm.kernels.op_coverage import OPTIONAL_OPS, REQUIRED_OPS  # noqa: E402

__all__ += ["DeviceUnavailableError", "ExecutionPlan", "KV_CACHE_FEED", "KernelError",
            "OPTIONAL_OPS", "REQUIRED_OPS", "STEP_FEEDS"]

# 1.7: recording a plan as it runs (ExecutionPlan.trace, kernel_generation) and profiling a
# compiled one
from tessellm.graph.plan import Instruction, PlanProfileSink, PlanTracer  # noqa: E402

__all__ += ["Instruction", "PlanProfileSink", "PlanTracer"]

# 1.8: speculative-decoding proposers (the tessellm_speculative_proposers hook)
from tessellm.speculative.config import SpeculativeConfig  # noqa: E402
from tessellm.speculative.proposer import Proposer  # noqa: E402

__all__ += ["Proposer", "SpeculativeConfig"]
