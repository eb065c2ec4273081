"""Makes lora_fixtures (next to this file), tests/models' hf_fixtures and tests/server's
server_fixtures importable."""
from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for _dir in (Path(__file__).resolve().parent, _TESTS / "models", _TESTS / "server"):
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))
