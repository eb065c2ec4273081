"""Suite-wide fixtures: an isolated cache dir, and the KV-leak check after every engine test."""
from __future__ import annotations

import weakref
from pathlib import Path

import pytest

from tessellm.engine.llm_engine import LLMEngine

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
STORIES = SHARED / "models" / "stories260K-hf"


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Profile decisions and the demo model go to a per-session dir, never ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TESSELLM_CACHE_DIR", str(tmp_path_factory.mktemp("tessellm-cache")))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _no_leaked_kv_blocks(monkeypatch: pytest.MonkeyPatch):
    """Every engine built during a test must end it with no unfinished request and every KV
    block free."""
    engines: list[weakref.ref[LLMEngine]] = []
    original_init = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        engines.append(weakref.ref(self))

    monkeypatch.setattr(LLMEngine, "__init__", tracking_init)
    yield
    for ref in engines:
        engine = ref()
        if engine is None:
            continue
        assert not engine.has_unfinished(), "engine test left unfinished requests"
        assert engine.kv.num_free_blocks == engine.kv.num_blocks, (
            f"KV blocks leaked: {engine.kv.num_blocks - engine.kv.num_free_blocks} "
            f"of {engine.kv.num_blocks} still held")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not STORIES.exists():
        pytest.fail(f"shared model missing: {STORIES}")
    return STORIES
