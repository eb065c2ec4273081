"""The speculative-proposer tutorial's plugin (docs/examples/speculative_proposer) adds the
`history` method: the plugin manager offers it, an engine speculates with it, drafts from an
earlier request are accepted, and the tokens are the plain engine's."""
from __future__ import annotations

import pytest

from tessellm import LLM, SamplingParams
from tessellm.errors import ConfigError
from tessellm.plugins import PluginManager

PROMPT = "Lily had a red ball. She liked to play with it every day. One day"


@pytest.fixture()
def manager(tutorial_plugins) -> PluginManager:
    return tutorial_plugins("speculative_proposer", "history_proposer",
                            "tessellm_history_proposer.plugin")


def test_the_tutorial_proposer_drafts_from_earlier_requests(manager, stories_dir):
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


def test_an_unknown_method_names_the_plugins_ones(manager, stories_dir):
    with pytest.raises(ConfigError, match=r"unknown speculative method 'suffix'.*history"):
        LLM(str(stories_dir), plugins=manager, load_progress=False,
            speculative_config={"method": "suffix", "num_speculative_tokens": 2})
