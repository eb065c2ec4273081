"""The device slot table (tessellm.lora.slots): layout of a fused site, LRU reuse, refusal
of more adapters than slots."""
from __future__ import annotations

import pytest
import torch

from tessellm.errors import TessellmError
from tessellm.lora.adapter import LoRAAdapter
from tessellm.lora.sites import LoRASite, SitePart
from tessellm.lora.slots import LoRASlotTable

R = 4
QKV = LoRASite(0, "qkv_proj", 8, (SitePart("q_proj", 0, 8), SitePart("k_proj", 8, 4),
                                  SitePart("v_proj", 12, 4)), "qkv.a", "qkv.b")


def _table(slots: int = 2) -> tuple[LoRASlotTable, dict]:
    weights = {"qkv.a": torch.zeros(slots, 3 * R, 8), "qkv.b": torch.zeros(slots, 3 * R, 16)}
    return LoRASlotTable([QKV], weights, slots, R), weights


def _adapter(int_id: int, modules=("q_proj", "v_proj"), rank: int = 2) -> LoRAAdapter:
    g = torch.Generator().manual_seed(int_id)
    sizes = {"q_proj": 8, "k_proj": 4, "v_proj": 4}
    return LoRAAdapter(f"a{int_id}", int_id, rank, 1.0, {
        (0, m): (torch.randn(rank, 8, generator=g), torch.randn(sizes[m], rank, generator=g))
        for m in modules})


def test_fused_site_holds_each_part_block_diagonally() -> None:
    table, w = _table()
    adapter = _adapter(1)
    slot = table.assign([adapter])[1]
    a, b = w["qkv.a"][slot], w["qkv.b"][slot].T
    qa, qb = adapter.weights[(0, "q_proj")]
    va, vb = adapter.weights[(0, "v_proj")]
    assert torch.equal(a[0:2], qa) and torch.equal(a[2 * R:2 * R + 2], va)
    assert torch.equal(b[0:8, 0:2], qb) and torch.equal(b[12:16, 2 * R:2 * R + 2], vb)
    # everything else is zero: k gets no term, and no part reads another part's rank
    mask = torch.zeros_like(b, dtype=torch.bool)
    mask[0:8, 0:2] = True
    mask[12:16, 2 * R:2 * R + 2] = True
    assert not b[~mask].any() and not a[2:2 * R].any() and not a[2 * R + 2:].any()
    x = torch.randn(3, 8)
    delta = (x @ a.T) @ b.T
    torch.testing.assert_close(delta[:, 0:8], (x @ qa.T) @ qb.T)
    assert not delta[:, 8:12].any()


def test_resident_adapters_keep_their_slot_and_lru_is_evicted() -> None:
    table, w = _table(2)
    a1, a2, a3 = _adapter(1), _adapter(2), _adapter(3)
    s = table.assign([a1, a2])
    assert sorted(s.values()) == [0, 1] and table.num_loads == 2
    assert table.assign([a2]) == {2: s[2]} and table.num_loads == 2   # no reload
    s3 = table.assign([a3, a2])          # a1 was used least recently: its slot goes to a3
    assert s3[3] == s[1] and s3[2] == s[2] and table.num_loads == 3
    # a slot rewritten for a smaller adapter keeps nothing of the old one
    small = _adapter(4, modules=("q_proj",), rank=1)
    slot = table.assign([small, a3])[4]
    assert not w["qkv.a"][slot, 1:].any() and not w["qkv.b"][slot, 1:].any()


def test_more_adapters_than_slots_in_one_step_is_refused() -> None:
    table, _ = _table(2)
    with pytest.raises(TessellmError, match="3 adapters, the slot table holds 2"):
        table.assign([_adapter(1), _adapter(2), _adapter(3)])


def test_evicted_adapter_is_written_again() -> None:
    table, _ = _table(2)
    table.assign([_adapter(1)])
    table.evict(1)
    table.assign([_adapter(1)])
    assert table.num_loads == 2
