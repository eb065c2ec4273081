"""Block tables as persistent per-request int32 rows (the model runner's host path), one set
per block-table group (tessellm.cache.kv_groups)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class BlockTableRows:
    """Each request's block table as a persistent int32 row, updated incrementally: a row is
    rebuilt only when the KV manager gave the request a new table list (copy-on-write,
    reallocation), else only the appended tail is copied. Filling a step's [B, width] table
    is then one memcpy per request, whatever the context length."""

    def __init__(self, max_blocks_per_seq: int, max_rows: int) -> None:
        self.width = max_blocks_per_seq
        self.max_rows = max_rows
        self._rows: dict[str, tuple[Sequence[int], np.ndarray, int]] = {}

    def row(self, request_id: str, table: Sequence[int]) -> np.ndarray:
        known = self._rows.get(request_id)
        if known is not None and known[0] is table:
            _, row, synced = known
            if len(table) > synced:
                row[synced:len(table)] = table[synced:]
        else:
            row = np.zeros(self.width, dtype=np.int32)
            row[:len(table)] = table
        self._rows[request_id] = (table, row, len(table))
        return row

    def fill(self, out: np.ndarray, request_ids: list[str],
             tables: list[Sequence[int]], width: int | None = None) -> int:
        """Write the rows of this step's requests into out[:len, :width] (width: the longest
        table unless given; columns past a table are 0); returns width."""
        width = width or max(1, max((len(t) for t in tables), default=1))
        for i, (rid, table) in enumerate(zip(request_ids, tables)):
            out[i, :width] = self.row(rid, table)[:width]
        if len(self._rows) > 2 * self.max_rows:   # forget requests that left
            keep = set(request_ids)
            self._rows = {k: v for k, v in self._rows.items() if k in keep}
        return width


def group_names(name: str, num_groups: int) -> list[str]:
    """A per-group staging buffer's names: `name` for the first block-table group, then
    name_<g>."""
    return [name] + [f"{name}_{g}" for g in range(1, num_groups)]


class GroupTableRows:
    """Every block-table group's BlockTableRows, each filling its group's host buffer
    (`names`: block_tables, block_tables_1, ...)."""

    def __init__(self, max_blocks_per_seq: int, max_rows: int, num_groups: int) -> None:
        self.groups = [BlockTableRows(max_blocks_per_seq, max_rows) for _ in range(num_groups)]
        self.names = group_names("block_tables", num_groups)

    def fill(self, bufs: dict[str, torch.Tensor], request_ids: list[str],
             by_group: list[list[Sequence[int]]], padded: int | None) -> int:
        """Each group's rows into host buffer bufs[its name] (the groups' tables row for row;
        none for a step of padding rows alone), padded to `padded` rows of the full width
        with the null block; returns the width (the first group's longest table unless
        padded)."""
        width = None
        by_group = by_group + [[]] * (len(self.groups) - len(by_group))
        for rows, name, tables in zip(self.groups, self.names, by_group):
            buf = bufs[name].numpy()
            width = rows.fill(buf, request_ids, tables,
                              width=rows.width if padded is not None else width)
            if padded is not None:
                buf[len(tables):padded] = 0
        return width
