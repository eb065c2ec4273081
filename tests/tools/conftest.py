"""Makes tests/models/hf_fixtures (the shared tokenizers) and tests/server/server_fixtures (its
chat template) importable."""
from __future__ import annotations

import sys
from pathlib import Path

for _name in ("models", "server"):
    _path = str(Path(__file__).resolve().parents[1] / _name)
    if _path not in sys.path:
        sys.path.insert(0, _path)
