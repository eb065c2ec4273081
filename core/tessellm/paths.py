"""Where tessellm keeps its caches (profile decisions, the demo model)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root(configured: str | None = None) -> Path:
    if configured:
        return Path(configured)
    env = os.environ.get("TESSELLM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tessellm"
