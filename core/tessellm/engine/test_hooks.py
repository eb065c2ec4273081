"""TEST HOOKS, off by default: fault and delay injection for the end-to-end server tests.

Read from the environment only when the server is started with the explicit test-only flag
`--enable-test-hooks` (an environment variable alone switches nothing on); the engine core
installs them after it is built. Nothing here runs otherwise.
- TESSELLM_TEST_FAIL_STEP_ON_PROMPT=<substring>: an engine step in which a scheduled request's
  decoded prompt contains <substring> raises (as a kernel failure would). The engine fails
  that step's requests and goes on; the tests check that nothing else is lost.
- TESSELLM_TEST_STEP_DELAY_S=<seconds>: every engine step sleeps that long first, so a test
  can hold requests running or waiting (backpressure, disconnects, shutdown).
Never set these in production: a warning is logged whenever one is active.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from tessellm.engine.llm_engine import LLMEngine
from tessellm.errors import ConfigError

FAIL_STEP_ON_PROMPT_ENV = "TESSELLM_TEST_FAIL_STEP_ON_PROMPT"
STEP_DELAY_ENV = "TESSELLM_TEST_STEP_DELAY_S"
HOOK_ENV_VARS = (FAIL_STEP_ON_PROMPT_ENV, STEP_DELAY_ENV)

log = logging.getLogger(__name__)


class InjectedStepFailure(RuntimeError):
    """Raised by the test hook inside an engine step."""


def install_test_hooks(engine: LLMEngine, tokenizer: Any, environ: Mapping[str, str]) -> list[str]:
    """Wrap engine.runner.launch per the environment; returns the hooks installed."""
    substring = environ.get(FAIL_STEP_ON_PROMPT_ENV) or None
    raw_delay = environ.get(STEP_DELAY_ENV) or None
    if substring is None and raw_delay is None:
        return []
    try:
        delay = float(raw_delay) if raw_delay is not None else 0.0
    except ValueError:
        raise ConfigError(f"{STEP_DELAY_ENV} must be a number of seconds, got {raw_delay!r}") \
            from None
    launch = engine.runner.launch

    def hooked_launch(out: Any, kv: Any, previous: Any = None) -> Any:
        if delay > 0:
            time.sleep(delay)
        if substring is not None:
            for s in out.scheduled:
                if substring in tokenizer.decode(s.request.prompt_token_ids):
                    raise InjectedStepFailure(f"test hook {FAIL_STEP_ON_PROMPT_ENV}: prompt of "
                                              f"{s.request.request_id} contains {substring!r}")
        return launch(out, kv, previous)

    engine.runner.launch = hooked_launch  # instance attribute shadows the method
    active = [name for name, on in ((FAIL_STEP_ON_PROMPT_ENV, substring is not None),
                                    (STEP_DELAY_ENV, delay > 0)) if on]
    log.warning("TEST HOOKS ACTIVE (never in production): %s", ", ".join(active))
    return active
