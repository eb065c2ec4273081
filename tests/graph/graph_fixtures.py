"""Tiny random models and a reference executor for the graph tests (no files, no engine).

`make_model(arch)` builds a ModelSpec from a small HF-style config dict, random weights under
the checkpoint's own names, adapts them and builds the unfused graph through the architecture
table, exactly as the loader does. The same (arch, seed) always gives the same weights, so two
calls give two independent but identical models: passes mutate a graph and its weights dict in
place, so a before/after comparison builds one model per side.

Graphs run without the engine: `run_graph` lowers with a KernelSelector over a registry of the
reference ops on a fake device "ref" (policy "first") and runs the plan on the feeds of
`prefill_feeds` (one sequence, one prefill step, zeroed KV caches in shuffled blocks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from tessellm.graph import ops
from tessellm.graph.ir import ModelGraph
from tessellm.graph.lowering import lower
from tessellm.graph.plan import ExecutionPlan
from tessellm.kernels.attention_metadata import AttentionMetadata, metadata_from_tables
from tessellm.kernels.examples import make_attention_metadata
from tessellm.kernels.profiler import KernelSelector
from tessellm.kernels.reference import REFERENCE_OPS
from tessellm.kernels.registry import Kernel, KernelRegistry
from tessellm.models.architectures import BUILTIN_ARCHITECTURES
from tessellm.models.spec import ModelSpec

REF_DEVICE = "ref"
BLOCK_SIZE = 4

_LLAMA_BASE = {
    "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 48, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64, "rope_theta": 10000.0, "hidden_act": "silu",
}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_BASE, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False},
    "qwen2": {**_LLAMA_BASE, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
    # head_dim 16 != hidden / heads, as in real Qwen3 checkpoints
    "qwen3": {**_LLAMA_BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16,
              "tie_word_embeddings": False},
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "vocab_size": 97, "n_embd": 32, "n_head": 4,
             "n_layer": 2, "n_positions": 64, "layer_norm_epsilon": 1e-5,
             "activation_function": "gelu_new"},
}
LLAMA_FAMILY = ("llama", "qwen2", "qwen3")


@dataclass
class TinyModel:
    spec: ModelSpec
    graph: ModelGraph


def _llama_checkpoint(s: ModelSpec, rnd) -> dict[str, torch.Tensor]:
    H, I, hd = s.hidden_size, s.intermediate_size, s.head_dim
    q_out, kv_out = s.num_heads * hd, s.num_kv_heads * hd
    w = {"model.embed_tokens.weight": rnd(s.vocab_size, H, std=1.0),
         "model.norm.weight": rnd(H, norm=True)}
    if not s.tie_word_embeddings:
        w["lm_head.weight"] = rnd(s.vocab_size, H)
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = rnd(H, norm=True)
        w[f"{p}.post_attention_layernorm.weight"] = rnd(H, norm=True)
        for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            w[f"{p}.self_attn.{name}.weight"] = rnd(out, H)
            if s.qkv_bias:
                w[f"{p}.self_attn.{name}.bias"] = rnd(out)
        w[f"{p}.self_attn.o_proj.weight"] = rnd(H, q_out)
        if s.qk_norm:
            w[f"{p}.self_attn.q_norm.weight"] = rnd(hd, norm=True)
            w[f"{p}.self_attn.k_norm.weight"] = rnd(hd, norm=True)
        w[f"{p}.mlp.gate_proj.weight"] = rnd(I, H)
        w[f"{p}.mlp.up_proj.weight"] = rnd(I, H)
        w[f"{p}.mlp.down_proj.weight"] = rnd(H, I)
    return w


def _gpt2_checkpoint(s: ModelSpec, rnd) -> dict[str, torch.Tensor]:
    """HF GPT-2 layout: Conv1D weights are [in, out], q/k/v fused in c_attn."""
    H, I = s.hidden_size, s.intermediate_size
    w = {"transformer.wte.weight": rnd(s.vocab_size, H, std=1.0),
         "transformer.wpe.weight": rnd(s.max_position_embeddings, H, std=0.5),
         "transformer.ln_f.weight": rnd(H, norm=True), "transformer.ln_f.bias": rnd(H)}
    for i in range(s.num_layers):
        p = f"transformer.h.{i}"
        for ln in ("ln_1", "ln_2"):
            w[f"{p}.{ln}.weight"], w[f"{p}.{ln}.bias"] = rnd(H, norm=True), rnd(H)
        for name, n_in, n_out in (("attn.c_attn", H, 3 * H), ("attn.c_proj", H, H),
                                  ("mlp.c_fc", H, I), ("mlp.c_proj", I, H)):
            w[f"{p}.{name}.weight"] = rnd(n_in, n_out, fan_in=n_in)
            w[f"{p}.{name}.bias"] = rnd(n_out)
        w[f"{p}.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))  # buffer the adapter drops
    return w


def make_model(arch: str, seed: int = 0) -> TinyModel:
    """A fresh unfused graph of a tiny random model of `arch` (a key of CONFIGS)."""
    config = CONFIGS[arch]
    entry = BUILTIN_ARCHITECTURES[config["architectures"][0]]
    spec = entry.spec(config)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float | None = None, norm: bool = False,
            fan_in: int | None = None) -> torch.Tensor:
        t = torch.randn(shape, generator=gen)
        if norm:
            return 1.0 + 0.1 * t
        if std is None:  # matrices: ~unit-variance outputs; vectors (biases): small
            std = (fan_in or shape[-1]) ** -0.5 if len(shape) == 2 else 0.1
        return t * std

    build = _gpt2_checkpoint if arch == "gpt2" else _llama_checkpoint
    weights = entry.adapt_weights(build(spec, rnd), spec)
    return TinyModel(spec, entry.build_graph(spec, weights))


def reference_registry(skip: Iterable[str] = (), device: str = REF_DEVICE) -> KernelRegistry:
    """A registry holding `ref_<op>` = the reference op for every op except those in skip."""
    registry = KernelRegistry()
    for op, fn in REFERENCE_OPS.items():
        if op not in skip:
            registry.register(Kernel(op, "ref_" + op, fn, device=device))
    return registry


def reference_selector(registry: KernelRegistry | None = None) -> KernelSelector:
    return KernelSelector(registry or reference_registry(), REF_DEVICE, "cpu", lambda: None,
                          policy="first")


def kv_caches(spec: ModelSpec, num_blocks: int, block_size: int = BLOCK_SIZE,
              dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros((2, num_blocks, spec.num_kv_heads, block_size, spec.head_dim),
                        dtype=dtype) for _ in range(spec.num_layers)]


def step_feeds(token_ids: list[int], positions: list[int], meta: AttentionMetadata,
               caches: list[torch.Tensor], logits_indices: list[int]) -> dict[str, Any]:
    feeds: dict[str, Any] = {
        "input_ids": torch.tensor(token_ids, dtype=torch.int64),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "attn_meta": meta,
        "logits_indices": torch.tensor(logits_indices, dtype=torch.int64)}
    feeds.update({f"kv_cache_{i}": c for i, c in enumerate(caches)})
    return feeds


def prompt(spec: ModelSpec, num_tokens: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, spec.vocab_size, (num_tokens,), generator=gen).tolist()


def prefill_feeds(spec: ModelSpec, num_tokens: int = 7, seed: int = 0) -> dict[str, Any]:
    """One sequence prefilled from position 0 in one step; logits of every token."""
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = make_attention_metadata([num_tokens], [num_tokens], BLOCK_SIZE, 0,
                                               "cpu", gen)
    return step_feeds(prompt(spec, num_tokens, seed), list(range(num_tokens)), meta,
                      kv_caches(spec, num_blocks), list(range(num_tokens)))


def metadata(query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
             num_decodes: int, block_size: int = BLOCK_SIZE) -> AttentionMetadata:
    """AttentionMetadata for given block tables (decodes first), slots from the tables."""
    return metadata_from_tables(query_lens, seq_lens, tables, num_decodes, block_size)


def lower_reference(mg: ModelGraph, registry: KernelRegistry | None = None) -> ExecutionPlan:
    return lower(mg, reference_selector(registry), torch.float32)


def run_graph(model: TinyModel, num_tokens: int = 7, seed: int = 0) -> torch.Tensor:
    """Logits [num_tokens, vocab] of one prefill of a seeded prompt through the lowered graph."""
    return lower_reference(model.graph).run(prefill_feeds(model.spec, num_tokens, seed))


def op_counts(mg: ModelGraph) -> dict[str, int]:
    """Device-op nodes by registry op name (attention included)."""
    counts: dict[str, int] = {}
    for node in mg.op_nodes():
        name = ops.op_name(node.target)
        counts[name] = counts.get(name, 0) + 1
    return counts


def weight_readers(mg: ModelGraph) -> set[str]:
    """Names of the weights some get_attr node reads."""
    return {n.target for n in mg.graph.nodes if n.op == "get_attr"}
