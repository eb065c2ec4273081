"""lora_add kernels against the reference op (tessellm.kernels.reference_lora): token counts
1..300, every slot and base rows mixed, one adapter on every row, no adapter at all."""
from __future__ import annotations

import pytest
import torch

from tessellm.kernels.portable_lora import lora_add_dense_slots
from tessellm.kernels.reference_lora import lora_add
from tessellm_cpu.lora import lora_add_grouped

KERNELS = {"dense_slots": lora_add_dense_slots, "grouped": lora_add_grouped}


def _case(rows: int, slots: torch.Tensor, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    S, R, i, o = 4, 16, 48, 40
    x = torch.randn((rows, i), generator=gen).to(dtype)
    y = torch.randn((rows, o), generator=gen).to(dtype)
    a = (torch.randn((S, R, i), generator=gen) * 0.2).to(dtype)
    b = (torch.randn((S, R, o), generator=gen) * 0.2).to(dtype)
    return x, y, a, b, slots


def test_reference_is_the_per_row_low_rank_term() -> None:
    x, y, a, b, slots = _case(5, torch.tensor([2, -1, 0, 2, 3]))
    out = lora_add(x, y, a, b, slots)
    for t, s in enumerate(slots.tolist()):
        expect = y[t] if s < 0 else y[t] + (x[t] @ a[s].T) @ b[s]
        torch.testing.assert_close(out[t], expect)
    assert torch.equal(out[1], y[1])   # a base-model row is y exactly


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 64, 129, 300])
def test_kernel_equals_reference_with_mixed_slots(name: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    slots = torch.randint(-1, 4, (rows,), generator=gen)
    args = _case(rows, slots, seed=rows)
    out = KERNELS[name](*args)
    torch.testing.assert_close(out, lora_add(*args), rtol=1e-5, atol=1e-5)
    base = slots < 0
    assert torch.equal(out[base], args[1][base])   # base-model rows untouched, exactly


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("slot", [-1, 0, 3])
def test_kernel_with_one_slot_on_every_row(name: str, slot: int) -> None:
    args = _case(9, torch.full((9,), slot))
    torch.testing.assert_close(KERNELS[name](*args), lora_add(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_in_bfloat16_close_to_reference(name: str) -> None:
    args = _case(33, torch.randint(-1, 4, (33,), generator=torch.Generator().manual_seed(3)),
                 dtype=torch.bfloat16)
    torch.testing.assert_close(KERNELS[name](*args).float(), lora_add(*args).float(),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_does_not_write_its_inputs(name: str) -> None:
    args = _case(6, torch.tensor([0, 1, -1, 1, 0, 3]))
    before = [t.clone() for t in args]
    KERNELS[name](*args)
    for t, old in zip(args, before):
        assert torch.equal(t, old)


def _native():
    from tessellm_cpu.native_lora import NativeLoRAAdd
    return NativeLoRAAdd()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 3, 64, 300])
def test_native_kernel_equals_reference(dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows + 7)
    slots = torch.randint(-1, 4, (rows,), generator=gen)
    args = _case(rows, slots, dtype=dtype, seed=rows)
    out = _native()(*args)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), lora_add(*args).float(), rtol=tol, atol=tol)
    base = slots < 0
    assert torch.equal(out[base], args[1][base])


def test_native_kernel_refuses_a_slot_out_of_range() -> None:
    args = _case(3, torch.tensor([0, 4, -1]))
    with pytest.raises(ValueError, match="slot outside"):
        _native()(*args)
