"""Built-in architectures: HF architecture name -> how to read its spec, adapt its weights and
build its graph. Plugins add more through the `tessellm_architectures` hook."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from tessellm.errors import UnsupportedModelError
from tessellm.graph.ir import ModelGraph
from tessellm.models import gpt2, llama, moe
from tessellm.models import phi3
from tessellm.models import gemma
from tessellm.models.spec import ModelSpec, gpt2_spec, llama_family_spec


@dataclass(frozen=True, slots=True)
class Architecture:
    spec: Callable[[dict[str, Any]], ModelSpec]
    adapt_weights: Callable[[dict[str, torch.Tensor], ModelSpec], dict[str, torch.Tensor]]
    build_graph: Callable[[ModelSpec, dict[str, torch.Tensor]], ModelGraph]
    # GGUF weights arrive under the graph's names (tessellm.models.gguf_file); this adds what
    # the graph needs beyond them (the rope table). None: the weights are used as they come.
    gguf_adapt: Callable[[dict[str, Any], ModelSpec], dict[str, Any]] | None = None

    def adapt_gguf_weights(self, weights: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
        return self.gguf_adapt(weights, spec) if self.gguf_adapt else weights


_LLAMA = Architecture(llama_family_spec, llama.adapt_llama_weights, llama.build_llama_graph,
                      llama.adapt_llama_weights)

_MOE = Architecture(moe.moe_spec, moe.adapt_moe_weights, llama.build_llama_graph,
                    moe.adapt_moe_weights)

_GEMMA = Architecture(gemma.gemma_spec, gemma.adapt_gemma_weights, gemma.build_gemma_graph,
                      gemma.adapt_gemma_gguf_weights)

BUILTIN_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "MixtralForCausalLM": _MOE,
    "Qwen2MoeForCausalLM": _MOE,
    "Qwen3MoeForCausalLM": _MOE,
    "Phi3ForCausalLM": Architecture(phi3.phi3_spec, phi3.adapt_phi3_weights,
                                    llama.build_llama_graph, phi3.adapt_phi3_weights),
    "GPT2LMHeadModel": Architecture(gpt2_spec, gpt2.adapt_gpt2_weights, gpt2.build_gpt2_graph),
    "Gemma2ForCausalLM": _GEMMA,
    "Gemma3ForCausalLM": _GEMMA,
    "Gemma3ForConditionalGeneration": _GEMMA,
}


def builtin_architecture_names() -> frozenset[str]:
    """The HF architecture names tessellm builds itself: a plugin's architecture of one of
    these names is refused unless the plugin declares the override (tessellm.plugins)."""
    return frozenset(BUILTIN_ARCHITECTURES)


def resolve_architecture(config: dict[str, Any],
                         extra: dict[str, Architecture] | None = None) -> Architecture:
    names = config.get("architectures") or []
    known = {**BUILTIN_ARCHITECTURES, **(extra or {})}
    for name in names:
        if name in known:
            return known[name]
    raise UnsupportedModelError(
        f"unsupported architecture {names or '(none in config.json)'}; "
        f"supported: {', '.join(sorted(known))}")
