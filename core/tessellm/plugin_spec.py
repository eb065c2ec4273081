"""pluggy hook specifications of the tessellm plugin contract (marker name "tessellm").

A plugin is a module found through the entry-point group `tessellm.plugins`. It must declare
`TESSELLM_API_VERSION = "<major>.<minor>"`; a different major version than API_VERSION, a
newer minor one, or a minor one older than what the plugin implements needs is refused
(tessellm.plugin_versions). Every hook is optional; each returns a list (or dict) that the
manager merges.

Names are never taken over silently: a kernel whose (device, op, name) is already registered,
an architecture name tessellm builds itself (or another plugin registered first) and a graph
pass named like a built-in or earlier pass are refused and reported on the plugin's record
(`tessellm plugins`). A plugin may replace built-in architectures only by naming them in
`TESSELLM_OVERRIDE_ARCHITECTURES` (a tuple of HF architecture names); the record lists them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from tessellm.device import DevicePlugin
    from tessellm.kernels.registry import Kernel

PROJECT = "tessellm"
ENTRY_POINT_GROUP = "tessellm.plugins"
# 1.1 (additive, plugins of 1.0 still load): packed weights (PackedWeight, PackedFormat,
# quantize, dequantize) and kernel weight layouts (WeightLayout, Kernel.weight_layout).
# 1.2 (additive): decode graphs (DevicePlugin.decode_graph_sizes, compile with a
# DecodeGraphShape), measured KV budgets (DevicePlugin.kv_cache_budget), padding slots (-1) that
# write_kv_cache kernels skip, static-shape steps (DevicePlugin.static_shapes, compile with a
# StaticStepShape), DevicePlugin.runtime_counters and kernels_not_offered, the portable
# kernels (plugin_api.portable), the sample_tokens op.
# 1.3 (additive): everything the architecture and graph-pass hooks need is in plugin_api
# (Architecture, ModelSpec and its readers, the Llama / GPT-2 builders and weight adapters,
# ModelGraph, GraphBuilder, graph_ops, GraphPass, linear_call, linear_dims);
# TESSELLM_OVERRIDE_ARCHITECTURES; name clashes are refused instead of first-wins only;
# tensor parallelism's Communicator and the optional DevicePlugin.communicator hook.
# 1.4 (additive): DevicePlugin.asynchronous (the default for async scheduling).
# 1.5 (additive): the apply_token_bitmask op (constrained decoding), the
# tessellm_tool_call_formats hook (plugin_api.CallFormat and the ToolCallFormat protocol).
# 1.6 (additive): the errors a plugin raises, DeviceUnavailableError (the device cannot be used,
# or its memory is exhausted) and KernelError (no kernel can run an op), exported by plugin_api;
# ExecutionPlan and the feed names of a step (STEP_FEEDS, KV_CACHE_FEED) that `compile` gets;
# REQUIRED_OPS / OPTIONAL_OPS (the ops a device must / may cover); DeviceAllocator.reserve
# (count bytes held elsewhere) and subclasses override public hooks only (raw_empty).
# 1.7 (additive): a plan can be recorded as it runs (ExecutionPlan.trace with a PlanTracer,
# Instruction, ExecutionPlan.kernel_generation) and a compiled plan profiled (its
# `profile_sink`, a PlanProfileSink): what the CPU plugin's native decode programs use.
# 1.8 (additive): the tessellm_speculative_proposers hook (speculative decoding proposers,
# plugin_api.Proposer and SpeculativeConfig).
# 1.9 (additive): DevicePlugin.prefers_int8_activations (what packed_activations="auto"
# picks) and the fused_moe_packed_q8act op (MoE experts with int8 activations).
API_VERSION = "1.9"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class TessellmHookSpecs:
    @hookspec
    def tessellm_devices(self) -> list["DevicePlugin"]:
        """Device plugins this package provides."""

    @hookspec
    def tessellm_kernels(self) -> list["Kernel"]:
        """Extra kernels, each for an existing device (Kernel.device names it)."""

    @hookspec
    def tessellm_architectures(self) -> dict[str, Any]:
        """HF architecture name (config.json "architectures") -> plugin_api.Architecture."""

    @hookspec
    def tessellm_graph_passes(self) -> list[Any]:
        """Extra graph passes (plugin_api.GraphPass), run after the built-in fusions and
        before dead-code removal, each only where the device has the ops it `requires`."""

    @hookspec
    def tessellm_tool_call_formats(self) -> list[Any]:
        """Extra tool-call formats (plugin_api.CallFormat, or any object with its `name`,
        `stream`, `parse_calls`, `matches_template` and `grammar`), chosen by
        --tool-call-parser NAME or by a chat template they match (after the built-in ones)."""

    @hookspec
    def tessellm_speculative_proposers(self) -> dict[str, Any]:
        """Speculative-decoding proposers: method name -> factory(SpeculativeConfig, engine
        parts) returning a plugin_api.Proposer, chosen by speculative_config.method."""
