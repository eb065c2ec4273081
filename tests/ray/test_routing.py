"""Routing over replicas without Ray: the router's policies, the prefix index, and the prefix
cache's change log that a replica's core publishes."""
from __future__ import annotations

import pytest
from tessellm.cache.prefix_cache import CachedBlockMap
from tessellm.errors import ConfigError
from tessellm.ray.prefix_index import PrefixIndex, prompt_hashes
from tessellm.ray.router import Candidate, Router


def test_least_loaded_takes_the_smallest_load_and_spreads_ties():
    r = Router()
    assert r.choose([Candidate(0, 3), Candidate(1, 1), Candidate(2, 2)]).index == 1
    picks = {r.choose([Candidate(0, 0), Candidate(1, 0)]).index for _ in range(4)}
    assert picks == {0, 1}


def test_prefix_aware_prefers_the_longest_match_then_the_load():
    r = Router("prefix-aware")
    assert r.choose([Candidate(0, 0, 0), Candidate(1, 2, 5)]).index == 1
    # a miss everywhere: least-loaded
    assert r.choose([Candidate(0, 2, 0), Candidate(1, 1, 0)]).index == 1
    # tied matches: the less loaded of the holders
    assert r.choose([Candidate(0, 3, 4), Candidate(1, 1, 4), Candidate(2, 0, 1)]).index == 1


def test_prefix_aware_does_not_overload_one_replica():
    r = Router("prefix-aware", balance_abs=4, balance_rel=1.5)
    assert r.choose([Candidate(0, 4, 9), Candidate(1, 0, 0)]).index == 0   # within the cap
    assert r.choose([Candidate(0, 5, 9), Candidate(1, 0, 0)]).index == 1   # past it


@pytest.mark.parametrize("options", [{"policy": "random"}, {"balance_abs": -1},
                                     {"balance_rel": 0.5}])
def test_bad_router_options_are_config_errors(options):
    with pytest.raises(ConfigError):
        Router(**options)


def test_prompt_hashes_are_the_kv_managers_chain():
    tokens = list(range(40))
    a = prompt_hashes(tokens, 16)
    assert len(a) == 2 and prompt_hashes(tokens[:32] + [7] * 8, 16) == a
    assert prompt_hashes(tokens, 16, lora_int_id=3) != a      # an adapter's KV is its own
    assert prompt_hashes(tokens, 16, cache_salt="s") != a


def test_prefix_index_matches_published_and_recently_routed_blocks():
    now = [0.0]
    index = PrefixIndex(routed_ttl_s=5.0, clock=lambda: now[0])
    chain = prompt_hashes(list(range(64)), 16)
    index.apply(chain[:2], [])
    assert index.match(chain) == 2
    index.apply([], [chain[0]])                  # evicted: the chain breaks at block 0
    assert index.match(chain) == 0
    index.note_routed(chain)                     # sent there: being computed
    assert index.match(chain) == 4
    now[0] = 6.0                                 # the routed entries expired
    assert index.match(chain) == 0
    index.apply(chain, [])
    index.clear()                                # the replica restarted: its cache is empty
    assert index.match(chain) == 0


def test_cached_block_map_change_log_is_the_net_change():
    m = CachedBlockMap()
    m.insert(b"a", 1)
    assert m.take_changes() == ([], [])          # not recording yet
    assert m.record_changes() == [b"a"]
    m.insert(b"b", 2)
    m.evict(1)
    m.insert(b"c", 3)
    m.evict(3)
    stored, removed = m.take_changes()
    assert stored == [b"b"] and sorted(removed) == [b"a", b"c"]
    assert m.take_changes() == ([], [])
