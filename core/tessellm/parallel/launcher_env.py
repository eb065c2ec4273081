"""Whether a launcher (torchrun) started this process: read from its environment, without
torch (the command line asks before it imports anything heavy)."""
from __future__ import annotations

import os


def launcher_environment() -> tuple[int, int] | None:
    """(rank, world size) when a launcher (torchrun) started this process, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None
