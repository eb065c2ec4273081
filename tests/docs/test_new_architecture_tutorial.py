"""The architecture tutorial (docs/examples/new_architecture): stories260K rewritten in Meta's
original layout (its make_checkpoint.py) is unknown to tessellm alone, and with the tutorial's
plugin runs end to end to the reference greedy tokens of the Hugging Face original."""
from __future__ import annotations

import importlib.metadata
import json
import runpy

import pytest

from docs_paths import EXAMPLES
from tessellm import LLM, SamplingParams
from tessellm.errors import UnsupportedModelError
from tessellm.plugin_spec import ENTRY_POINT_GROUP
from tessellm.plugins import PluginManager

TUTORIAL = EXAMPLES / "new_architecture"


def _manager(*extra: importlib.metadata.EntryPoint) -> PluginManager:
    cpu = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
           if ep.name == "cpu"]
    return PluginManager(cpu + list(extra)).load()


@pytest.fixture()
def meta_checkpoint(tmp_path, stories_dir):
    out = tmp_path / "stories260K-meta"
    runpy.run_path(str(TUTORIAL / "make_checkpoint.py"))["convert"](stories_dir, out)
    return out


def test_the_plugin_serves_the_meta_layout_to_the_reference_tokens(meta_checkpoint, stories_dir,
                                                                   on_sys_path) -> None:
    names = set(json.loads((meta_checkpoint / "config.json").read_text()))
    assert {"dim", "n_layers", "hidden_dim"} <= names and "hidden_size" not in names
    options = dict(device="cpu", dtype="float32", load_progress=False, kernel_selection="first")
    with pytest.raises(UnsupportedModelError, match="MetaLlamaForCausalLM"):
        LLM(str(meta_checkpoint), plugins=_manager(), **options)
    on_sys_path(TUTORIAL / "src")
    plugin = importlib.metadata.EntryPoint(name="meta_llama", value="tessellm_meta_llama.plugin",
                                           group=ENTRY_POINT_GROUP)
    llm = LLM(str(meta_checkpoint), plugins=_manager(plugin), **options)
    ref = json.loads((stories_dir / "reference_greedy.json").read_text())
    out = llm.generate([ref["prompt"]], SamplingParams(max_tokens=ref["max_new_tokens"],
                                                       temperature=0.0))[0]
    assert llm.encode(ref["prompt"]) + out.token_ids == ref["token_ids"]


def test_without_the_rotary_reordering_the_tokens_differ(meta_checkpoint, stories_dir,
                                                          on_sys_path, monkeypatch) -> None:
    """The reordering is what makes the tokens right (the test above could not pass by luck)."""
    on_sys_path(TUTORIAL / "src")
    import tessellm_meta_llama.plugin as plugin_module
    monkeypatch.setattr(plugin_module, "rotary_rows_to_halves", lambda w, heads: w)
    plugin = importlib.metadata.EntryPoint(name="meta_llama", value="tessellm_meta_llama.plugin",
                                           group=ENTRY_POINT_GROUP)
    llm = LLM(str(meta_checkpoint), plugins=_manager(plugin), device="cpu", dtype="float32",
              load_progress=False, kernel_selection="first")
    ref = json.loads((stories_dir / "reference_greedy.json").read_text())
    out = llm.generate([ref["prompt"]], SamplingParams(max_tokens=ref["max_new_tokens"],
                                                       temperature=0.0))[0]
    assert llm.encode(ref["prompt"]) + out.token_ids != ref["token_ids"]
