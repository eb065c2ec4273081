"""What the leader (rank 0, which schedules and samples) tells its worker ranks, as msgspec
structs over the control channel. A worker replays them in order: after `WorkerInit` it
builds its shard; then every `BlockOps` and `Batch` is the same device work rank 0 does."""
from __future__ import annotations

import msgspec


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
    """One forward pass, as staged on the host (padding applied): the rows of each input,
    the block table's [rows, width] int32 bytes (empty on rank 0, which fills its own) and
    the padding (num_tokens, num_seqs, decode) when the step is padded."""

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


class Stop(msgspec.Struct, tag="stop"):
    pass


ControlMessage = WorkerInit | BlockOps | Batch | Stop
