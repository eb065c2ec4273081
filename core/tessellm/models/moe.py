"""Mixture-of-experts families on the Llama block: Mixtral, Qwen2-MoE and Qwen3-MoE.

The attention half of every layer is its dense family's (Mixtral: Mistral's; Qwen2-MoE:
Qwen2's, with qkv bias; Qwen3-MoE: Qwen3's, with q/k norm). The MLP of an expert layer is
  weights, ids = moe_router(gate(n))                       top-k of the router's scores
  y = fused_moe(n, experts.gate_up_proj, experts.down_proj, weights, ids)
  y += sigmoid_gate(shared_expert_gate(n), shared_expert(n))   (Qwen2-MoE's shared expert)
as graph ops, never a loop over experts in the graph. Layers the config keeps dense
(Qwen's `mlp_only_layers`, `decoder_sparse_step`) use the dense MLP.

Weights are read under one layout whatever the checkpoint's: `{p}.mlp.gate.weight` (the
router, [E, H]), `{p}.mlp.experts.gate_up_proj` [E * 2I, H] (expert e's gate rows, then its
up rows) and `{p}.mlp.experts.down_proj` [E * H, I] (kernels.reference_moe), the shared
expert's `{p}.mlp.shared_expert.{gate,up,down}_proj` and `{p}.mlp.shared_expert_gate`. The
adapter stacks HF's per-expert tensors (`experts.{e}.gate_proj` / Mixtral's `w1`, `w3`, `w2`
under `block_sparse_moe`) or reshapes transformers 5's stacked 3-D ones.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from tessellm.errors import ModelLoadError, UnsupportedModelError
from tessellm.graph import ops
from tessellm.graph.ir import GraphBuilder
from tessellm.models.spec import ModelSpec, llama_family_spec
from tessellm.quant.formats import PackedWeight, concat_rows, dequantize


@dataclass(slots=True, frozen=True)
class MoESpec:
    """The expert layers of a model: which layers route, over how many experts, how."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    layers: tuple[int, ...]             # the layers whose MLP is a mixture
    scoring: str = "softmax"
    shared_expert_intermediate_size: int = 0   # 0: no shared expert

    def is_expert_layer(self, layer: int) -> bool:
        return layer in self.layers


# HF architecture -> the dense family whose attention (and dense layers) it shares
DENSE_BASE = {"MixtralForCausalLM": "MistralForCausalLM",
              "Qwen2MoeForCausalLM": "Qwen2ForCausalLM",
              "Qwen3MoeForCausalLM": "Qwen3ForCausalLM"}


def _positive(config: dict[str, Any], keys: str, arch: str) -> int:
    """The first of `keys` (space-separated: the name hub configs use, then transformers 5's)
    the config sets, checked to be a positive integer."""
    names = keys.split()
    value = next((config[k] for k in names if config.get(k) is not None), None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedModelError(f"{arch}: config {names[0]} must be a positive integer, "
                                    f"got {value!r}")
    return value


def moe_spec(config: dict[str, Any]) -> ModelSpec:
    arch = config["architectures"][0]
    base = dict(config, architectures=[DENSE_BASE[arch]])
    if arch == "MixtralForCausalLM":
        experts = _positive(config, "num_local_experts num_experts", arch)
        inter = _positive(config, "intermediate_size", arch)
        renormalize, shared = True, 0
        layers = tuple(range(int(config["num_hidden_layers"])))
    else:
        experts = _positive(config, "num_experts num_local_experts", arch)
        inter = _positive(config, "moe_intermediate_size", arch)
        renormalize = bool(config.get("norm_topk_prob", False))
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(int(config["num_hidden_layers"]))
                       if i not in dense and (i + 1) % step == 0)
    top_k = _positive(config, "num_experts_per_tok", arch)
    if top_k > experts:
        raise UnsupportedModelError(f"{arch}: num_experts_per_tok ({top_k}) exceeds the "
                                    f"{experts} experts")
    if arch == "MixtralForCausalLM" or "intermediate_size" not in config:
        base["intermediate_size"] = inter   # no dense layer reads it
    dense_spec = llama_family_spec(base)
    moe = MoESpec(experts, top_k, inter, renormalize, layers,
                  shared_expert_intermediate_size=shared)
    return replace(dense_spec, architecture=arch, moe=moe)


def _stack_experts(weights: dict[str, Any], prefix: str, names: tuple[str, ...],
                   count: int) -> Any:
    """Expert e's tensors named `names` (in order), concatenated by rows, for every e."""
    parts = []
    for e in range(count):
        for name in names:
            key = f"{prefix}.{e}.{name}.weight"
            if key not in weights:
                raise ModelLoadError(f"MoE checkpoint lacks {key}")
            parts.append(weights.pop(key))
    if isinstance(parts[0], PackedWeight):
        return concat_rows(parts)
    return torch.cat(parts, dim=0)


_MIXTRAL = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(.*)$")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _unify_names(weights: dict[str, Any]) -> dict[str, Any]:
    """Mixtral's `block_sparse_moe.{gate, experts.e.w1/w3/w2}` under Qwen's names."""
    out = {}
    for name, t in weights.items():
        m = _MIXTRAL.match(name)
        if m:
            rest = m.group(2)
            for old, new in _MIXTRAL_EXPERT.items():
                rest = re.sub(rf"^experts\.(\d+)\.{old}\.", rf"experts.\1.{new}.", rest)
            name = f"{m.group(1)}.mlp.{rest}"
        out[name] = t
    return out


def adapt_moe_weights(weights: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """The Llama adaptation (rope table), then each expert layer's experts stacked."""
    from tessellm.models.llama import adapt_llama_weights
    moe = spec.moe
    out = _unify_names(adapt_llama_weights(weights, spec))
    for i in moe.layers:
        p = f"model.layers.{i}.mlp.experts"
        gate_up, down = out.get(f"{p}.gate_up_proj"), out.get(f"{p}.down_proj")
        gate = out.pop(f"{p}.gate_proj.weight", None)
        if gate is not None:   # a GGUF file's stacks (tessellm.models.gguf_moe)
            out[f"{p}.gate_up_proj"] = _interleave(gate, out.pop(f"{p}.up_proj.weight"),
                                                   moe.num_experts)
            out[f"{p}.down_proj"] = out.pop(f"{p}.down_proj.weight")
        elif gate_up is not None and down is not None:   # transformers 5's 3-D tensors
            out[f"{p}.gate_up_proj"] = gate_up.reshape(-1, gate_up.shape[-1])
            out[f"{p}.down_proj"] = down.reshape(-1, down.shape[-1])
        else:
            out[f"{p}.gate_up_proj"] = _stack_experts(out, p, ("gate_proj", "up_proj"),
                                                      moe.num_experts)
            out[f"{p}.down_proj"] = _stack_experts(out, p, ("down_proj",), moe.num_experts)
        out[f"{p}.gate_up_proj"], out[f"{p}.down_proj"] = _one_kind(
            out[f"{p}.gate_up_proj"], out[f"{p}.down_proj"])
        _check_expert_shapes(out, p, spec)
        shared_gate = f"model.layers.{i}.mlp.shared_expert_gate.weight"
        if shared_gate in out and out[shared_gate].dim() == 1:   # GGUF stores it as [H]
            out[shared_gate] = out[shared_gate].unsqueeze(0)
    return out


def _interleave(gate: Any, up: Any, experts: int) -> Any:
    """Stacks of E gate and E up row blocks -> expert e's gate rows then its up rows, for
    every e (packed rows stay packed when both stacks share a format)."""
    if isinstance(gate, PackedWeight) and isinstance(up, PackedWeight) \
            and gate.format == up.format:
        data = torch.cat((gate.data.view(experts, -1, gate.data.shape[1]),
                          up.data.view(experts, -1, up.data.shape[1])), dim=1)
        return gate.with_data(data.reshape(-1, gate.data.shape[1]))
    if isinstance(gate, PackedWeight) or isinstance(up, PackedWeight):
        raise ModelLoadError(f"MoE experts: gate ({_kind(gate)}) and up ({_kind(up)}) stacks "
                             "of different formats are not supported (load with "
                             "quantization='none' to dequantize them)")
    return torch.cat((gate.view(experts, -1, gate.shape[1]),
                      up.view(experts, -1, up.shape[1])), dim=1).reshape(-1, gate.shape[1])


def _one_kind(w13: Any, w2: Any) -> tuple[Any, Any]:
    """Both stacks packed (fused_moe_packed) or both dense (fused_moe): a file that packs
    one but not the other (rows not a multiple of the block) has the packed one expanded."""
    packed13, packed2 = isinstance(w13, PackedWeight), isinstance(w2, PackedWeight)
    if packed13 == packed2:
        return w13, w2
    if packed13:
        return dequantize(w13, w2.dtype), w2
    return w13, dequantize(w2, w13.dtype)


def _kind(w: Any) -> str:
    return w.format.name if isinstance(w, PackedWeight) else str(w.dtype)


def _check_expert_shapes(weights: dict[str, Any], prefix: str, spec: ModelSpec) -> None:
    moe, h = spec.moe, spec.hidden_size
    e, inter = moe.num_experts, moe.expert_intermediate_size
    want = {f"{prefix}.gate_up_proj": (e * 2 * inter, h), f"{prefix}.down_proj": (e * h, inter)}
    for name, shape in want.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise ModelLoadError(f"{name} has shape {got}, the config says {shape} "
                                 f"({e} experts of {inter} features, hidden {h})")


def expert_mlp(b: GraphBuilder, n: Any, spec: ModelSpec, layer: int) -> Any:
    """The MoE MLP of layer `layer` on the normed hidden states `n`."""
    moe, h = spec.moe, spec.hidden_size
    p = f"model.layers.{layer}.mlp"
    router = b.linear(n, f"{p}.gate", role="router", layer=layer, bias=False)
    routed = b.op(ops.moe_router, router, moe.top_k, moe.renormalize, moe.scoring,
                  dims={"experts": moe.num_experts, "top_k": moe.top_k,
                        "renormalize": int(moe.renormalize),
                        "sigmoid": int(moe.scoring == "sigmoid")}, role="moe_router",
                  layer=layer)
    w13 = b.weight(f"{p}.experts.gate_up_proj")
    w2 = b.weight(f"{p}.experts.down_proj")
    packed = isinstance(b.weights[f"{p}.experts.gate_up_proj"], PackedWeight)
    dims = {"hidden": h, "features": moe.expert_intermediate_size,
            "experts": moe.num_experts, "top_k": moe.top_k}
    if packed:
        w = b.weights[f"{p}.experts.gate_up_proj"]
        dims["qtype"] = w.format.ggml_type
        dims["qtype_down"] = b.weights[f"{p}.experts.down_proj"].format.ggml_type
    y = b.op(ops.fused_moe_packed if packed else ops.fused_moe, n, w13, w2,
             b.item(routed, 0), b.item(routed, 1), dims=dims, role="experts", layer=layer)
    if not moe.shared_expert_intermediate_size:
        return y
    from tessellm.models.llama import dense_mlp
    shared = dense_mlp(b, n, spec, layer, f"{p}.shared_expert",
                       moe.shared_expert_intermediate_size, role_prefix="shared_")
    gate = b.linear(n, f"{p}.shared_expert_gate", role="shared_expert_gate", layer=layer,
                    bias=False)
    gated = b.op(ops.sigmoid_gate, gate, shared, dims={"hidden": h}, role="shared_gate",
                 layer=layer)
    return b.op(ops.add, y, gated, dims={"features": h}, role="moe_sum", layer=layer)
