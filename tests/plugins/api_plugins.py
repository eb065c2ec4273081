"""A plugin written against tessellm.plugin_api alone (reached by the fake entry point
"api_plugins:plugin"): a new architecture name served by the public Llama builder, a graph
pass that tags every linear node (no numerics change), so a test sees it ran, and a tool-call
format (Granite's `<|tool_call|>[...]`)."""
from __future__ import annotations

from types import SimpleNamespace

from tessellm.plugin_api import (
    Architecture,
    CallFormat,
    GraphPass,
    ModelGraph,
    ModelSpec,
    adapt_llama_weights,
    build_llama_graph,
    graph_ops,
    hookimpl,
    llama_family_spec,
)

TAG = "visited_by_api_plugin"


def build_tiny_stories(spec: ModelSpec, weights) -> ModelGraph:
    """The public Llama builder: a new name for a graph tessellm already knows how to build."""
    return build_llama_graph(spec, weights)


def tag_linears(mg: ModelGraph) -> ModelGraph:
    """Marks every linear node (a pass that changes no numerics)."""
    for node in mg.op_nodes(graph_ops.linear):
        node.meta[TAG] = True
    return mg


ARCHITECTURE = Architecture(llama_family_spec, adapt_llama_weights, build_tiny_stories,
                            adapt_llama_weights)
PASS = GraphPass("tag_linears", tag_linears, ("linear",))
GRANITE = CallFormat("granite", start="<|tool_call|>", array=True,
                     template_markers=("<|tool_call|>",))


@hookimpl
def tessellm_architectures() -> dict[str, Architecture]:
    return {"TinyStoriesForCausalLM": ARCHITECTURE}


@hookimpl
def tessellm_graph_passes() -> list[GraphPass]:
    return [PASS]


@hookimpl
def tessellm_tool_call_formats() -> list[CallFormat]:
    return [GRANITE]


plugin = SimpleNamespace(TESSELLM_API_VERSION="1.5", tessellm_architectures=tessellm_architectures,
                         tessellm_graph_passes=tessellm_graph_passes,
                         tessellm_tool_call_formats=tessellm_tool_call_formats)
