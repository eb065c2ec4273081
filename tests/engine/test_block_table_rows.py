"""BlockTableRows: persistent per-request block-table rows, refreshed only where the KV
manager's table changed (an appended tail, or a new list after copy-on-write/reallocation)."""
from __future__ import annotations

import numpy as np

from tessellm.engine.block_table_rows import BlockTableRows


def test_rows_follow_appends_and_new_lists() -> None:
    rows = BlockTableRows(max_blocks_per_seq=6, max_rows=2)
    a, b = [3, 4], [9]
    out = np.full((2, 6), -1, dtype=np.int32)
    assert rows.fill(out, ["a", "b"], [a, b]) == 2
    assert out[:2, :2].tolist() == [[3, 4], [9, 0]]       # padding is the null block 0
    a.append(7)                                         # a grows in place: tail copied
    assert rows.fill(out, ["a", "b"], [a, b]) == 3
    assert out[:2, :3].tolist() == [[3, 4, 7], [9, 0, 0]]
    a2 = [3, 8, 7]                                      # copy-on-write: a new list
    assert rows.fill(out, ["b", "a"], [b, a2]) == 3     # batch order changed too
    assert out[:2, :3].tolist() == [[9, 0, 0], [3, 8, 7]]


def test_rows_of_requests_that_left_are_forgotten() -> None:
    rows = BlockTableRows(max_blocks_per_seq=2, max_rows=1)
    out = np.zeros((1, 2), dtype=np.int32)
    for i in range(5):
        rows.fill(out, [f"r{i}"], [[i + 1]])
    assert len(rows._rows) <= 2


def test_copy_on_write_gives_the_request_a_new_table_list() -> None:
    from tessellm.cache.kv_manager import KVCacheManager
    from tessellm.request import Request
    from tessellm.sampling_params import SamplingParams
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    parent = Request("p", [1, 2, 3, 4, 5, 6], SamplingParams(), 0.0)
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = Request("c", [1, 2, 3, 4, 5, 6], SamplingParams(), 0.0)
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    before = kv.block_table_view("c")
    assert kv.allocate_slots(child, 1)       # writes into the shared partial block
    after = kv.block_table_view("c")
    assert after is not before and after[1] != before[1] and after[0] == before[0]
