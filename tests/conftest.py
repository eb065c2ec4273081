"""Suite-wide fixtures: an isolated cache dir, and the KV-leak check after every engine test."""
from __future__ import annotations

import os
import weakref
from pathlib import Path

import pytest

from tessellm.engine.llm_engine import LLMEngine

# Triton decides at `triton.jit` time whether a kernel runs in its interpreter, so this is set
# before anything imports tessellm_cuda's kernels: the `triton-interpret` device (CPU tensors
# through Triton's interpreter) is then available to the suite. Its priority is below cpu, so
# device="auto" never picks it. A GPU run sets TRITON_INTERPRET=0 explicitly.
os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED = Path(os.environ.get("TESSELLM_SHARED_DIR")
              or Path(__file__).resolve().parents[1].parent / "shared")
STORIES = SHARED / "models" / "stories260K-hf"


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Profile decisions and the demo model go to a per-session dir, never ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TESSELLM_CACHE_DIR", str(tmp_path_factory.mktemp("tessellm-cache")))
    yield
    mp.undo()


class _EngineTracker:
    """Every LLMEngine built in the session: weakly for the session, strongly for the test
    that built it (so an engine local to a test is still checked when the test ends)."""

    def __init__(self) -> None:
        self.session: list[weakref.ref[LLMEngine]] = []
        self.this_test: list[LLMEngine] = []

    def add(self, engine: LLMEngine) -> None:
        self.session.append(weakref.ref(engine))
        self.this_test.append(engine)

    def live(self) -> list[LLMEngine]:
        return [e for e in (r() for r in self.session) if e is not None]


@pytest.fixture(scope="session")
def _engines():
    tracker = _EngineTracker()
    original_init = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        tracker.add(self)

    mp = pytest.MonkeyPatch()
    mp.setattr(LLMEngine, "__init__", tracking_init)
    yield tracker
    mp.undo()


@pytest.fixture(autouse=True)
def _no_leaked_kv_blocks(_engines):
    """After every test, every engine alive (or built by the test) has no unfinished request
    and every KV block free."""
    yield
    try:
        for engine in _engines.live():
            assert not engine.has_unfinished(), "engine test left unfinished requests"
            assert engine.kv.num_free_blocks == engine.kv.num_blocks, (
                f"KV blocks leaked: {engine.kv.num_blocks - engine.kv.num_free_blocks} "
                f"of {engine.kv.num_blocks} still held")
    finally:
        _engines.this_test.clear()


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not STORIES.exists():
        pytest.fail(f"shared model missing: {STORIES}")
    return STORIES


@pytest.fixture(scope="session")
def qwen3_random_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Qwen3 of small shape (tests/models/hf_fixtures.py) with the real Qwen3
    tokenizer and chat template (which renders tools), saved as a model directory."""
    import sys
    models = str(Path(__file__).resolve().parent / "models")
    if models not in sys.path:
        sys.path.insert(0, models)
    from hf_fixtures import CASES, build_hf_model, save_model_dir
    case = CASES["qwen3"]
    tokenizer = case.tokenizer()
    return save_model_dir(build_hf_model(case, tokenizer), tokenizer,
                          tmp_path_factory.mktemp("qwen3-random"))
