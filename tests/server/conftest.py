"""Fixtures of the server tests (helpers: server_fixtures.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from server_fixtures import CHAT_TEMPLATE
from tessellm import LLM


@pytest.fixture(scope="session")
def offline(stories_dir: Path) -> LLM:
    """The offline engine the server's greedy text is compared with (same options)."""
    return LLM(str(stories_dir), dtype="float32", kernel_selection="first", load_progress=False)


@pytest.fixture(scope="session")
def chat_template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "template.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path
