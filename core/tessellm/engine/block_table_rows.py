"""Block tables as persistent per-request int32 rows (the model runner's host path)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
