"""Assemble an engine's parts from an EngineConfig: device, model graph, passes, kernels,
weights on the device, the KV cache and the ExecutionPlan."""
from __future__ import annotations

import logging
import math
import os
import platform
from dataclasses import dataclass, field, replace
from typing import Any

import torch

import tessellm
from tessellm.cache.kv_groups import KVCacheLayout
from tessellm.cache.sliding_window import kv_blocks_bound
from tessellm.config import EngineConfig
from tessellm.device import DevicePlugin, host_memory_info
from tessellm.errors import ConfigError, DeviceUnavailableError
from tessellm.graph.lowering import lower
from tessellm.graph.passes import GraphPass, PassReport, default_passes, run_passes
from tessellm.engine.memory_profile import profile_forward
from tessellm.graph.plan import ExecutionPlan
from tessellm.kernels.profiler import KernelSelector, ProfileCache, token_bucket
from tessellm.kernels.registry import KernelRegistry
from tessellm.lora.sites import LoRASite, add_lora_sites
from tessellm.graph.passes.dead_code import remove_dead_code
from tessellm.graph.passes.quantize_linears import quantize_linears
from tessellm.graph.passes.q8_activations import q8_activations, q8_activations_experts
from tessellm.graph import ops
from tessellm.models.hf_files import eos_token_ids
from tessellm.models.architectures import resolve_architecture
from tessellm.models.pipeline import check_stageable, stage_graph
from tessellm.models.sharding import check_shardable, shard_model
from tessellm.models.loader import checkpoint_dtype, load_model, open_source, read_source_config
from tessellm.models.source_tokenizer import load_source_tokenizer
from tessellm.models.source import ModelSource, model_source_of
from tessellm.models.spec import ModelSpec
from tessellm.quant.formats import FORMATS_BY_NAME, PackedWeight
from tessellm.paths import cache_root
from tessellm.parallel.group import ParallelGroup, require_torch_backend
from tessellm.parallel.launch import parallel_layout, start_group
from tessellm.engine.step_rows import max_graph_rows
from tessellm.speculative.proposer import known_proposer
from tessellm.plugins import PluginManager

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 4 << 30  # like vLLM's CPU default; sized down to what can be used


@dataclass
class EngineParts:
    config: EngineConfig
    device: DevicePlugin
    spec: ModelSpec
    dtype: torch.dtype
    tokenizer: Any
    eos_token_ids: frozenset[int]
    plan: ExecutionPlan
    selector: KernelSelector
    pass_report: PassReport
    kv_caches: list[torch.Tensor]   # the KV tensors; layer i's is kv_layout.layer_tensors[i]
    num_kv_blocks: int
    max_model_len: int
    source: ModelSource
    weights: dict[str, torch.Tensor | PackedWeight]  # on the device, by graph name
    host_kv_caches: list[torch.Tensor] = field(default_factory=list)  # swap mode's host pool
    # tensor / pipeline parallelism: this rank's place in the group (None: one rank); `spec`
    # stays the whole model's, the plan, weights and KV caches are this rank's shard (of its
    # stage's layers)
    parallel: ParallelGroup | None = None
    # speculation: the proposers plugins register (method name -> factory), built-ins aside
    proposers: dict[str, Any] = field(default_factory=dict)
    # LoRA (enable_lora): the graph's adapter sites; their slot tables are in `weights`
    lora_sites: list[LoRASite] = field(default_factory=list)
    # block-table groups (tessellm.cache.kv_groups; None: one, a KV tensor per layer)
    kv_layout: KVCacheLayout | None = None
    # how the packed linears take their input as built ("auto" resolved): q8_0 or float
    packed_activations: str = "float"

    @property
    def is_demo(self) -> bool:
        return self.source.is_demo

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights as held (packed ones as stored)."""
        return weight_bytes(self.weights)

    @property
    def num_host_kv_blocks(self) -> int:
        return self.host_kv_caches[0].shape[1] if self.host_kv_caches else 0


PACKED_OPS = ("linear_packed", "embedding_packed")
Q8ACT_OP = "linear_packed_q8act"
Q8ACT_EXPERTS_OP = "fused_moe_packed_q8act"
DEAD_CODE = GraphPass("remove_dead_code", remove_dead_code)
QUANTIZE_AT_LOAD = {"int8": "q8_0", "q8_0": "q8_0", "q4_0": "q4_0", "q4_1": "q4_1"}


def keep_packed(config: EngineConfig, source: ModelSource, device: DevicePlugin,
                registry: KernelRegistry) -> bool:
    """Whether a GGUF file's packed tensors stay packed (quantization "auto" on a device
    with packed kernels); a safetensors model asked to quantize needs those kernels too."""
    has_kernels = all(registry.has_op(device.name, op) for op in PACKED_OPS)
    if config.quantization in QUANTIZE_AT_LOAD:
        if source.kind == "gguf":
            raise ConfigError(f"quantization={config.quantization!r} quantizes a safetensors "
                              "model at load; a GGUF file runs as stored (auto) or "
                              "dequantized (none)")
        if not registry.has_op(device.name, "linear_packed"):
            raise ConfigError(f"quantization={config.quantization!r}: device {device.name!r} "
                              "has no linear_packed kernel")
    if source.kind != "gguf" or config.quantization != "auto":
        return False
    if not has_kernels:
        log.warning("device %r has no packed-weight kernels (%s): the GGUF weights are "
                    "dequantized at load", device.name, ", ".join(PACKED_OPS))
    return has_kernels


def weight_bytes(weights: dict[str, torch.Tensor | PackedWeight]) -> int:
    """Packed weights and kernel layouts (WeightLayout.prepare's objects) count `nbytes`."""
    return sum(w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes
               for w in weights.values())


def _upload(device: DevicePlugin, w: torch.Tensor | PackedWeight) -> torch.Tensor | PackedWeight:
    if isinstance(w, PackedWeight):
        return w.with_data(device.upload(w.data.contiguous(), tag="weights"))
    return device.upload(w.contiguous(), tag="weights")


def make_selector(config: EngineConfig, registry: KernelRegistry,
                  device: DevicePlugin) -> KernelSelector:
    identity = (f"{device.name}-{device.version}|torch={torch.__version__}"
                f"|tessellm={tessellm.__version__}|{platform.machine()}|threads={torch.get_num_threads()}")
    replayed = frozenset() if config.enforce_eager else frozenset(
        token_bucket(s) for s in device.decode_graph_sizes(max_graph_rows(config)))
    return KernelSelector(
        registry, device.name, device.torch_device_type, device.synchronize,
        policy=config.kernel_selection,
        cache=ProfileCache(cache_root(config.cache_dir) / "kernel_profile.json"),
        identity=identity, replayed_buckets=replayed)


def kv_layout(config: EngineConfig, spec: ModelSpec, num_local_layers: int) -> KVCacheLayout:
    """The block-table groups and KV tensors (tessellm.cache.kv_groups): the model's own, but
    one group under pipeline parallelism (a stage holds part of the layers; a hybrid model's
    stages hold their whole context, as every layer did before the groups)."""
    if config.pipeline_parallel_size == 1:
        return spec.kv_layout
    window = spec.sliding_window if spec.all_layers_windowed else 0
    return KVCacheLayout.of([window] * num_local_layers)


def kv_block_bytes(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype,
                   layout: KVCacheLayout | None = None) -> int:
    """Bytes of one KV block: K and V of its tokens in every KV tensor (one per layer unless
    `layout` shares tensors between block-table groups)."""
    tensors = spec.num_layers if layout is None else layout.num_tensors
    return (2 * config.block_size * spec.num_kv_heads * spec.head_dim
            * torch.empty((), dtype=dtype).element_size() * tensors)


def kv_block_count(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype,
                   max_model_len: int, measured_bytes: int | None = None,
                   layout: KVCacheLayout | None = None) -> int:
    """num_kv_blocks, or as many blocks as the budget holds (kv_cache_bytes, else the device's
    measured budget, else DEFAULT_KV_CACHE_BYTES), but no more than max_num_seqs sequences of
    max_model_len tokens can hold at once (with sliding windows: their bound)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_block_bytes(config, spec, dtype, layout)
    budget = config.kv_cache_bytes or measured_bytes or DEFAULT_KV_CACHE_BYTES
    if measured_bytes is not None and measured_bytes < per_block:
        raise DeviceUnavailableError(
            f"no device memory left for the KV cache: {measured_bytes} bytes free after the "
            f"weights and the activation peak, one block needs {per_block}; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens")
    windows = (0,) if layout is None else layout.windows
    useful = config.max_num_seqs * kv_blocks_bound(windows, config.block_size, max_model_len,
                                                   config.max_num_batched_tokens)
    return max(1, min(budget // per_block, useful))


# The share of the host's available memory a default-sized swap pool may take (all ranks of
# the machine together): the pool is page-locked where the device pins (cuda), so it cannot
# be paged out, and one sized like a large GPU's KV cache would exhaust the host.
HOST_POOL_SHARE = 0.5


def host_kv_block_count(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype,
                        num_kv_blocks: int, layout: KVCacheLayout | None = None) -> int:
    """Host blocks for swap preemption: 0 in recompute mode; else num_host_kv_blocks, or as
    many as swap_space_bytes hold, or (default) as many as the device pool but at most what
    HOST_POOL_SHARE of the host's available memory holds, split among the tensor-parallel
    ranks."""
    if config.preemption_mode != "swap":
        return 0
    if config.num_host_kv_blocks is not None:
        return config.num_host_kv_blocks
    per_block = kv_block_bytes(config, spec, dtype, layout)
    if config.swap_space_bytes is not None:
        return max(1, config.swap_space_bytes // per_block)
    share = int(host_memory_info().free_bytes * HOST_POOL_SHARE) // config.world_size
    if share // per_block < num_kv_blocks:
        log.info("swap: host pool capped at %d blocks (%.1f GiB, %.0f%% of the host's "
                 "available memory), the device pool has %d", max(1, share // per_block),
                 share / 2**30, 100 * HOST_POOL_SHARE, num_kv_blocks)
    return max(1, min(num_kv_blocks, share // per_block))


def build_engine_parts(config: EngineConfig, plugins: PluginManager | None = None,
                       extra_passes: list[GraphPass] | None = None,
                       parallel: ParallelGroup | None = None,
                       core_tokenizer: bool = False) -> EngineParts:
    """The parts of an engine, or of one rank of a tensor-parallel engine: with
    tensor_parallel_size > 1 rank 0 (parallel None) starts the group here; a worker passes
    the group it joined. Every rank runs the same steps in the same order (they meet in
    collectives: the compute group, the KV block count, a measuring forward pass).
    core_tokenizer: the engine runs in a core process whose front end holds the full
    tokenizer, so what the core reads of one is enough (load_source_tokenizer's core_only)."""
    plugins = plugins or PluginManager().load()
    if config.speculative_config is not None:   # an unknown method: refused before loading
        known_proposer(config.speculative_config.method, plugins.speculative_proposers())
    device = plugins.select_device(config.device)
    source = model_source_of(config)
    opened = open_source(source)   # a GGUF header, parsed once for config, weights, tokenizer
    hf_config = read_source_config(source, opened)
    world = config.world_size
    if world > 1:   # refused before any worker starts
        full_spec = resolve_architecture(hf_config, plugins.architectures()).spec(hf_config)
        check_shardable(full_spec, config.tensor_parallel_size)
        check_stageable(full_spec.num_layers, config.pipeline_parallel_size)
        own_comm = type(device).communicator is not DevicePlugin.communicator
        if own_comm and config.pipeline_parallel_size > 1:
            raise ConfigError(f"pipeline_parallel_size > 1 is not supported on device "
                              f"{device.name!r}, whose plugin brings its own communicator "
                              "(stages send over torch.distributed)")
    if parallel is None and world > 1:
        if type(device).communicator is DevicePlugin.communicator:
            require_torch_backend(device)
        parallel = start_group(config)
        try:
            return _build(config, plugins, extra_passes, device, source, hf_config, parallel,
                          opened, core_tokenizer)
        except BaseException:
            parallel.shutdown()
            raise
    return _build(config, plugins, extra_passes, device, source, hf_config, parallel, opened,
                  core_tokenizer)


def _threads(config: EngineConfig) -> int | None:
    """Threads per rank: num_threads, else the cores shared among this machine's ranks."""
    if config.num_threads:
        return config.num_threads
    if config.world_size == 1:
        return None
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size))
    return max(1, (os.cpu_count() or 1) // local_ranks)


def _build(config: EngineConfig, plugins: PluginManager, extra_passes: list[GraphPass] | None,
           device: DevicePlugin, source: ModelSource, hf_config: dict[str, Any],
           parallel: ParallelGroup | None, opened: Any = None,
           core_tokenizer: bool = False) -> EngineParts:
    threads = _threads(config)
    if threads:
        torch.set_num_threads(threads)
    registry = plugins.kernel_registry()
    comm = parallel.connect_device(device, parallel_layout(config)) \
        if parallel is not None else None
    dtype = config.torch_dtype(checkpoint_dtype(hf_config))
    leader = parallel is None or parallel.is_leader
    loaded = load_model(source, dtype, progress=config.load_progress and leader,
                        keep_packed=keep_packed(config, source, device, registry),
                        extra_architectures=plugins.architectures(), config=hf_config,
                        opened=opened)
    spec = local_spec = loaded.spec
    graph = loaded.graph
    if parallel is not None and config.tensor_parallel_size > 1:
        graph, local_spec = shard_model(graph, spec, loaded.build_graph, parallel.tp_rank,
                                        config.tensor_parallel_size)
    if parallel is not None and config.pipeline_parallel_size > 1:   # this stage's layers
        graph = stage_graph(graph, config.pipeline_parallel_size, parallel.stage)
        local_spec = replace(local_spec, num_layers=graph.num_layers)
    max_model_len = config.max_model_len or spec.max_position_embeddings
    if max_model_len > spec.max_position_embeddings:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's "
                          f"{spec.max_position_embeddings} positions")
    passes = default_passes() if config.graph_passes == "default" else []
    if config.quantization in QUANTIZE_AT_LOAD:  # after fusion, before dead-code removal
        fmt = FORMATS_BY_NAME[QUANTIZE_AT_LOAD[config.quantization]]
        quantize = GraphPass(f"quantize_{fmt.name.lower()}",
                             lambda mg: quantize_linears(mg, fmt), ("linear_packed",))
        passes = passes[:-1] + [quantize] + passes[-1:] if passes else [quantize, DEAD_CODE]
    if resolve_packed_activations(config, device, registry) == "q8_0":
        q8 = [GraphPass("q8_activations", q8_activations, (Q8ACT_OP,)),
              GraphPass("q8_activations_experts", q8_activations_experts, (Q8ACT_EXPERTS_OP,))]
        passes = passes[:-1] + q8 + passes[-1:] if passes else q8 + [DEAD_CODE]
    passes = passes[:-1] + list(plugins.graph_passes()) + (extra_passes or []) + passes[-1:]
    lora_sites: list[LoRASite] = []
    if config.enable_lora:   # last before dead-code removal: one site per final linear
        passes = _with_lora_pass(config, passes, lora_sites, dtype, device, registry)
    graph, report = run_passes(graph, passes, lambda op: registry.has_op(device.name, op))
    int8_inputs = bool(graph.op_nodes(ops.linear_packed_q8act))
    if config.packed_activations == "q8_0" and not int8_inputs:
        raise ConfigError("packed_activations='q8_0' applies to packed weights (a GGUF file "
                          "with quantization auto, or quantization int8/q8_0/q4_0/q4_1); "
                          "this model has none")
    if int8_inputs and graph.op_nodes(ops.fused_moe_packed):
        log.warning("packed_activations=%r: device %r has no %s kernel, so the MoE experts "
                    "take float activations (the other packed linears int8)",
                    config.packed_activations, device.name, Q8ACT_EXPERTS_OP)
    if int8_inputs and config.packed_activations == "auto":
        log.info("packed linears take int8 activations (packed_activations auto on device "
                 "%r: llama.cpp's way)", device.name)
    if config.enable_lora and not lora_sites:
        raise ConfigError(f"enable_lora: model {spec.architecture!r} has no linear an adapter "
                          "can target (q/k/v/o/gate/up/down projections of a Llama-style "
                          "decoder layer)")
    graph.weights.update({name: _upload(device, w) for name, w in graph.weights.items()})
    n_bytes = weight_bytes(graph.weights)
    log.info("weights: %.1f MiB on %s%s", n_bytes / 2**20, device.name,
             f" (packed: {', '.join(f'{k} x{v}' for k, v in sorted(loaded.packed_types.items()))})"
             if loaded.packed_types else "")
    selector = make_selector(config, registry, device)
    plan = lower(graph, selector, dtype, comm)
    measured = None
    if config.num_kv_blocks is None and config.kv_cache_bytes is None:
        measured = device.kv_cache_budget(
            profile_forward(plan, local_spec, config, device, dtype, max_model_len),
            config.gpu_memory_utilization)
    # the KV budget is per rank; a rank's blocks hold its KV heads of its stage's layers only
    layout = kv_layout(config, spec, local_spec.num_layers)
    num_blocks = kv_block_count(config, local_spec, dtype, max_model_len, measured, layout)
    num_host = host_kv_block_count(config, local_spec, dtype, num_blocks, layout)
    if parallel is not None:   # the one block table every rank indexes
        num_blocks = parallel.min_over_ranks(num_blocks)
        num_host = parallel.min_over_ranks(num_host)
    alloc = device.allocator()
    # one more physical block than usable ones: block 0 is the KV manager's null block
    kv_shape = (local_spec.num_kv_heads, config.block_size, local_spec.head_dim)
    kv_caches = [alloc.allocate((2, num_blocks + 1, *kv_shape), dtype, tag="kv_cache")
                 for _ in range(layout.num_tensors)]
    host = device.host_allocator()   # same per-tensor layout; no null block on the host
    host_kv_caches = [host.allocate((2, num_host, *kv_shape), dtype)
                      for _ in range(layout.num_tensors)] if num_host else []
    tokenizer = (load_source_tokenizer(source, opened, cache_root(config.cache_dir),
                                       core_only=core_tokenizer)
                 if leader else None)  # workers never decode
    return EngineParts(config, device, spec, dtype, tokenizer, eos_token_ids(hf_config, tokenizer),
                       plan, selector, report, kv_caches, num_blocks, max_model_len, source,
                       graph.weights, host_kv_caches, parallel,
                       plugins.speculative_proposers(), lora_sites, layout,
                       "q8_0" if int8_inputs else "float")


def resolve_packed_activations(config: EngineConfig, device: DevicePlugin,
                               registry: KernelRegistry) -> str:
    """config.packed_activations with "auto" resolved: "q8_0" where the device says int8
    activations pay (DevicePlugin.prefers_int8_activations: a CPU with VNNI) and has the
    kernel, else "float". An explicit "q8_0" needs the kernel (ConfigError)."""
    if config.packed_activations == "q8_0" and not registry.has_op(device.name, Q8ACT_OP):
        raise ConfigError(f"packed_activations='q8_0': device {device.name!r} has no "
                          f"{Q8ACT_OP} kernel")
    if config.packed_activations != "auto":
        return config.packed_activations
    pays = device.prefers_int8_activations() and registry.has_op(device.name, Q8ACT_OP)
    return "q8_0" if pays else "float"


def _with_lora_pass(config: EngineConfig, passes: list[GraphPass], sites: list[LoRASite],
                    dtype: torch.dtype, device: DevicePlugin,
                    registry: KernelRegistry) -> list[GraphPass]:
    """`passes` with add_lora_sites before dead-code removal (its sites land in `sites`)."""
    if not registry.has_op(device.name, "lora_add"):
        raise ConfigError(f"enable_lora: device {device.name!r} has no lora_add kernel")

    def add_sites(mg):
        mg, found = add_lora_sites(mg, config.max_loras, config.max_lora_rank, dtype)
        sites.extend(found)
        return mg
    lora = GraphPass("add_lora_sites", add_sites, ("lora_add",))
    if passes and passes[-1].name == DEAD_CODE.name:
        return passes[:-1] + [lora] + passes[-1:]
    return passes + [lora]
