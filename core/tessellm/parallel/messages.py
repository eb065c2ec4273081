"""What the leader (rank 0, which schedules and samples) tells its worker ranks, as msgspec
structs over the control channel. A worker replays them in order: after `WorkerInit` it
builds its shard; then every `BlockOps` and `Batch` is the same device work rank 0 does,
and every `LoRALoad` the same LoRA slot write (before the Batch that reads it)."""
from __future__ import annotations

import msgspec

from tessellm.engine.step_inputs import ForwardRows


class WorkerInit(msgspec.Struct, tag="init"):
    config_json: str           # the EngineConfig every rank builds from


class BlockOps(msgspec.Struct, tag="block_ops"):
    """A step's KV block work (tessellm.engine.kv_swap), by block id. `written_in_full`: the
    fresh blocks whose every slot the step's own forward pass writes, which are not zeroed."""

    swap_out: list[tuple[int, int]]
    fresh: list[int]
    copies: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    written_in_full: list[int] = []

    @property
    def empty(self) -> bool:
        return not (self.swap_out or self.fresh or self.copies or self.swap_in)


class Batch(msgspec.Struct, tag="batch"):
    """One forward pass on the wire: the leader's ForwardRows (tessellm.engine.step_inputs)
    field by field and the block table's [rows, width] int32 bytes (a hybrid model's other
    block-table groups: their tables and slot mappings too)."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    logits_indices: list[int]
    num_decodes: int
    rows: int
    width: int
    pad: tuple[int, int, bool] | None = None
    tables: bytes = b""
    lora_slots: list[int] = []
    group_slots: list[list[int]] = []
    group_tables: list[bytes] = []

    @classmethod
    def of(cls, rows: ForwardRows, tables: bytes, group_tables: list[bytes]) -> Batch:
        return cls(rows.token_ids, rows.positions, rows.slot_mapping, rows.seq_lens,
                   rows.query_lens, rows.logits_indices, rows.num_decodes, rows.rows,
                   rows.width, rows.pad, tables, rows.lora_slots, rows.group_slots,
                   group_tables)

    def forward_rows(self) -> ForwardRows:
        return ForwardRows(self.token_ids, self.positions, self.slot_mapping, self.seq_lens,
                           self.query_lens, self.logits_indices, self.num_decodes, self.rows,
                           self.width, None if self.pad is None else tuple(self.pad),
                           self.lora_slots, self.group_slots)


class LoRALoad(msgspec.Struct, tag="lora_load"):
    """Put a LoRA adapter into a slot of the worker's table (the leader wrote its own for the
    next Batch); the worker reads it from `path` and keeps its split."""

    slot: int
    name: str
    int_id: int
    path: str


class Stop(msgspec.Struct, tag="stop"):
    pass


ControlMessage = WorkerInit | BlockOps | Batch | LoRALoad | Stop
