"""The pipeline split in the graph (tessellm.models.pipeline) on its own, no processes: the
layers split into balanced contiguous stages; each stage's graph holds its layers' nodes,
weights and KV placeholders only (renumbered from 0), takes the hidden state when it is not
the first and returns it when it is not the last; a split that leaves a stage without a layer
is a clear error."""
from __future__ import annotations

import pytest
import torch

from tessellm.errors import ConfigError
from tessellm.graph import ops
from tessellm.models.llama import adapt_llama_weights, build_llama_graph
from tessellm.models.pipeline import HIDDEN_FEED, check_stageable, stage_graph, stage_layers
from tessellm.models.spec import ModelSpec
from tessellm.parallel.layout import RankLayout


def _llama(layers: int):
    spec = ModelSpec(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16,
                     num_layers=layers, num_heads=2, num_kv_heads=1, head_dim=8,
                     intermediate_size=24, norm_eps=1e-5, max_position_embeddings=64,
                     tie_word_embeddings=True)
    w = {"model.embed_tokens.weight": torch.zeros(32, 16), "model.norm.weight": torch.ones(16)}
    for i in range(layers):
        p = f"model.layers.{i}"
        w.update({f"{p}.input_layernorm.weight": torch.ones(16),
                  f"{p}.post_attention_layernorm.weight": torch.ones(16),
                  f"{p}.self_attn.q_proj.weight": torch.zeros(16, 16),
                  f"{p}.self_attn.k_proj.weight": torch.zeros(8, 16),
                  f"{p}.self_attn.v_proj.weight": torch.zeros(8, 16),
                  f"{p}.self_attn.o_proj.weight": torch.zeros(16, 16),
                  f"{p}.mlp.gate_proj.weight": torch.zeros(24, 16),
                  f"{p}.mlp.up_proj.weight": torch.zeros(24, 16),
                  f"{p}.mlp.down_proj.weight": torch.zeros(16, 24)})
    return build_llama_graph(spec, adapt_llama_weights(w, spec))


@pytest.mark.parametrize("layers,stages,want", [
    (5, 2, [range(0, 3), range(3, 5)]), (4, 4, [range(i, i + 1) for i in range(4)]),
    (7, 3, [range(0, 3), range(3, 5), range(5, 7)]), (3, 1, [range(0, 3)])])
def test_layers_split_into_balanced_contiguous_stages(layers, stages, want):
    assert [stage_layers(layers, stages, s) for s in range(stages)] == want


def test_each_stage_holds_its_layers_only():
    full = _llama(5)
    graphs = [stage_graph(full, 2, s) for s in range(2)]
    for g, layers, first, last in ((graphs[0], range(0, 3), True, False),
                                   (graphs[1], range(3, 5), False, True)):
        assert g.num_layers == len(layers)
        names = [n.target for n in g.graph.nodes if n.op == "placeholder"]
        assert [n for n in names if n.startswith("kv_cache_")] == [
            f"kv_cache_{i}" for i in range(len(layers))]
        assert (HIDDEN_FEED in names) == (not first)
        assert ("input_ids" in names) == first and ("logits_indices" in names) == last
        held = {int(k.split(".")[2]) for k in g.weights if k.startswith("model.layers.")}
        assert held == set(layers)
        assert {n.meta["layer"] for n in g.graph.nodes if "layer" in n.meta} == set(layers)
        assert g.count(ops.attention) == len(layers)
        assert ("model.norm.weight" in g.weights) == last
        # the tied LM head reads the embedding: both stages hold it, stage 0 for the lookup
        assert "model.embed_tokens.weight" in g.weights
        assert (g.count(ops.embedding) == 1) == first
    out = next(n for n in graphs[0].graph.nodes if n.op == "output").args[0]
    assert out.meta["role"] == "mlp_residual" and out.meta["layer"] == 2


def test_a_stage_without_a_layer_is_a_clear_error():
    with pytest.raises(ConfigError, match="pipeline_parallel_size=6 exceeds the model's 5"):
        check_stageable(5, 6)
    with pytest.raises(ConfigError, match="must be >= 1"):
        check_stageable(5, 0)
    with pytest.raises(ConfigError, match="exceeds"):
        stage_graph(_llama(2), 3, 0)


def test_rank_layout_tp_by_pp():
    layout = RankLayout(tp=2, pp=2)
    assert layout.world == 4 and layout.logits_rank == 2
    assert [layout.stage_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.tp_rank_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert layout.stage_ranks(1) == [2, 3]
    assert layout.describe(3) == "pipeline stage 1 (rank 3)"
    assert RankLayout(tp=2).describe(1) == "tensor-parallel rank 1"
