"""The speculative-proposer tutorial's plugin (docs/examples/speculative_proposer) adds the
`history` method: the plugin manager offers it, an engine speculates with it, drafts from an
earlier request are accepted, and the tokens are the plain engine's."""
from __future__ import annotations

import importlib.metadata

import pytest

from docs_paths import EXAMPLES
from tessellm import LLM, SamplingParams
from tessellm.errors import ConfigError
from tessellm.plugin_spec import ENTRY_POINT_GROUP
from tessellm.plugins import PluginManager

PROMPT = "Lily had a red ball. She liked to play with it every day. One day"


def _manager(on_sys_path) -> PluginManager:
    on_sys_path(EXAMPLES / "speculative_proposer" / "src")
    cpu = [e for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
           if e.name == "cpu"]
    tutorial = importlib.metadata.EntryPoint(name="history_proposer",
                                             value="tessellm_history_proposer.plugin",
                                             group=ENTRY_POINT_GROUP)
    return PluginManager(cpu + [tutorial]).load()


def test_the_tutorial_proposer_drafts_from_earlier_requests(on_sys_path, stories_dir):
    manager = _manager(on_sys_path)
    assert list(manager.speculative_proposers()) == ["history"]
    record = next(r for r in manager.records if r.name == "history_proposer")
    assert record.status == "loaded" and record.error is None
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(str(stories_dir), dtype="float32", load_progress=False)
    want = plain.generate([PROMPT], params)[0].token_ids
    llm = LLM(str(stories_dir), plugins=manager, dtype="float32", load_progress=False,
              speculative_config={"method": "history", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 3, "adaptive": False})
    assert llm.generate([PROMPT], params)[0].token_ids == want   # nothing learned yet
    assert llm.engine.speculator.stats.accepted_tokens == 0
    assert llm.generate([PROMPT], params)[0].token_ids == want   # drafts from the first run
    stats = llm.engine.speculator.stats
    assert stats.accepted_tokens > 20 and stats.acceptance_rate > 0.8


def test_an_unknown_method_names_the_plugins_ones(on_sys_path, stories_dir):
    with pytest.raises(ConfigError, match=r"unknown speculative method 'suffix'.*history"):
        LLM(str(stories_dir), plugins=_manager(on_sys_path), load_progress=False,
            speculative_config={"method": "suffix", "num_speculative_tokens": 2})
