"""tessellm.plugin_api carries everything the four hooks need (API 1.3, additive): a plugin
written against it alone adds an architecture and a graph pass that the engine uses."""
from __future__ import annotations

import importlib.metadata
import json
import shutil

import pytest

import tessellm.plugin_api as api
from tessellm import LLM, SamplingParams
from tessellm.errors import UnsupportedModelError
from tessellm.plugin_spec import API_VERSION, ENTRY_POINT_GROUP
from tessellm.plugins import PluginManager


def test_every_exported_name_exists_and_the_version_is_1_9() -> None:
    assert API_VERSION == "1.9" and api.API_VERSION == API_VERSION
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert missing == []
    hook_needs = {"DevicePlugin", "Kernel", "KernelQuery", "Architecture", "ModelSpec",
                  "llama_family_spec", "gpt2_spec", "build_llama_graph", "build_gpt2_graph",
                  "adapt_llama_weights", "adapt_gpt2_weights", "ModelGraph", "GraphBuilder",
                  "GraphPass", "graph_ops", "linear_call", "linear_dims", "hookimpl",
                  "ExecutionPlan", "STEP_FEEDS", "KV_CACHE_FEED", "REQUIRED_OPS",
                  "OPTIONAL_OPS", "DeviceUnavailableError", "KernelError", "Instruction",
                  "PlanTracer", "PlanProfileSink"}
    assert hook_needs <= set(api.__all__)
    assert api.builtin_architecture_names() >= {"LlamaForCausalLM", "GPT2LMHeadModel"}


def test_older_minor_versions_still_load() -> None:
    pm = PluginManager().load()   # sim declares 1.0, cpu 1.1
    status = {r.name: (r.status, r.error) for r in pm.records}
    assert status["sim"] == ("loaded", None) and status["cpu"][0] == "loaded"


@pytest.fixture()
def renamed_stories(tmp_path, stories_dir):
    """stories260K under an architecture name tessellm does not know."""
    model = tmp_path / "tiny-stories"
    shutil.copytree(stories_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["TinyStoriesForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    return model


def _manager(*fake: str) -> PluginManager:
    cpu = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == "cpu"]
    return PluginManager(cpu + [importlib.metadata.EntryPoint(name=n, value=f"api_plugins:{n}",
                                                              group=ENTRY_POINT_GROUP)
                                for n in fake]).load()


def test_a_public_api_plugin_adds_an_architecture_and_a_pass(renamed_stories, stories_dir) -> None:
    with pytest.raises(UnsupportedModelError, match="TinyStoriesForCausalLM"):
        LLM(str(renamed_stories), plugins=_manager(), device="cpu", dtype="float32",
            load_progress=False, kernel_selection="first")
    llm = LLM(str(renamed_stories), plugins=_manager("plugin"), device="cpu", dtype="float32",
              load_progress=False, kernel_selection="first")
    assert "tag_linears" in llm.engine.parts.pass_report.applied
    ref = json.loads((stories_dir / "reference_greedy.json").read_text())
    out = llm.generate([ref["prompt"]], SamplingParams(max_tokens=ref["max_new_tokens"],
                                                       temperature=0.0))[0]
    assert llm.encode(ref["prompt"]) + out.token_ids == ref["token_ids"]


def test_a_public_api_plugin_adds_a_tool_call_format() -> None:
    from tessellm.tools.formats import choose_format
    formats = _manager("plugin").tool_call_formats()
    assert [f.name for f in formats] == ["granite"]
    fmt = choose_format("{{ '<|tool_call|>' }}", extra=formats)
    assert fmt.name == "granite"
    parsed = fmt.parse_calls('<|tool_call|>[{"name": "f", "arguments": {"a": 1}}]')
    assert [(c.name, c.arguments) for c in parsed.calls] == [("f", '{"a": 1}')]
    assert choose_format(None, "granite", formats) is fmt
    assert _manager().tool_call_formats() == []


def test_tessellm_plugins_prints_refusals_and_declared_overrides(monkeypatch, capsys) -> None:
    from tessellm.cli.main import main
    pm = PluginManager([importlib.metadata.EntryPoint(name=n, value=f"broken_plugins:{n}",
                                                      group=ENTRY_POINT_GROUP)
                        for n in ("overrides_llama", "takes_llama", "takes_hermes",
                                  "not_a_format")])
    monkeypatch.setattr("tessellm.plugins.PluginManager", lambda: pm)
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "overrides built-in architecture LlamaForCausalLM (declared)" in out
    assert "'LlamaForCausalLM' is already provided by plugin 'overrides_llama'" in out
    assert "graph pass 'fuse_qkv' would override the one of 'tessellm' (refused)" in out
    assert "tool-call format 'hermes' would override the one of 'tessellm' (refused)" in out
    assert "lacks stream, parse_calls, matches_template, grammar (ignored)" in out
