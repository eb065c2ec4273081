"""Makes lora_fixtures (next to this file) and tests/models' hf_fixtures importable."""
from __future__ import annotations

import sys
from pathlib import Path

for _dir in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "models"):
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))
