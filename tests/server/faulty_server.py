"""Fault and delay injection for the server tests, owned by the tests (the shipped server has
no such switch).

`StepFaults` wraps an engine's `runner.launch`: every step first sleeps `delay_s`, and a step
in which a scheduled request's decoded prompt contains `fail_on_prompt` raises
InjectedStepFailure, as a kernel failure would (the engine fails that step's requests and goes
on). `install` does it to an engine in this process; `faulty_core_entry` is an engine-core
process target (EngineCoreClient.spawn's `entry`) that installs the faults on the engine the
real `core_process_main` builds. Run as a script, this module is `tessellm serve` with such a
core: `python faulty_server.py '<StepFaults as JSON>' serve <serve options>`.
"""
from __future__ import annotations

import functools
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any


class InjectedStepFailure(RuntimeError):
    """Raised by StepFaults inside an engine step."""


@dataclass(frozen=True)
class StepFaults:
    fail_on_prompt: str | None = None
    delay_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def install(self, engine: Any, tokenizer: Any) -> None:
        """Wrap `engine.runner.launch` (an instance attribute shadowing the method)."""
        launch = engine.runner.launch

        def launch_with_faults(out: Any, kv: Any, previous: Any = None) -> Any:
            if self.delay_s > 0:
                time.sleep(self.delay_s)
            if self.fail_on_prompt is not None:
                for s in out.scheduled:
                    if self.fail_on_prompt in tokenizer.decode(s.request.prompt_token_ids):
                        raise InjectedStepFailure(
                            f"injected: prompt of {s.request.request_id} contains "
                            f"{self.fail_on_prompt!r}")
            return launch(out, kv, previous)

        engine.runner.launch = launch_with_faults


def faulty_core_entry(faults: StepFaults, *core_args: Any) -> None:
    """The engine-core process's target: the real core main, `faults` installed on its engine
    (LLMEngine's constructor is wrapped in this process only, which is the tests' own)."""
    from tessellm.engine.engine_core import core_process_main
    from tessellm.engine.llm_engine import LLMEngine
    build = LLMEngine.__init__

    def build_with_faults(engine: LLMEngine, *args: Any, **kwargs: Any) -> None:
        build(engine, *args, **kwargs)
        faults.install(engine, engine.parts.tokenizer)

    LLMEngine.__init__ = build_with_faults  # type: ignore[method-assign]
    core_process_main(*core_args)


def main(argv: list[str]) -> int:
    """`tessellm serve` (argv[1:], parsed by the real CLI) over a core with StepFaults(argv[0])."""
    from tessellm.cli.commands import serve_configs
    from tessellm.cli.main import build_parser
    from tessellm.errors import TessellmError
    from tessellm.server.serve import run_server
    faults = StepFaults(**json.loads(argv[0]))
    a = build_parser().parse_args(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run_server(*serve_configs(a),
                          core_entry=functools.partial(faulty_core_entry, faults))
    except TessellmError as e:
        print(f"tessellm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
