"""Where the documentation lives: the repository, docs/ and the tutorials' examples."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
EXAMPLES = DOCS / "examples"
