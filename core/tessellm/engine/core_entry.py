"""The engine-core process's entry point as the front end names it: a function of a module
that imports nothing, so spawning the core costs the front end no torch import (the spawned
interpreter imports the engine itself)."""
from __future__ import annotations


def core_entry(*args: object) -> None:
    from tessellm.engine.engine_core import core_process_main
    core_process_main(*args)  # type: ignore[arg-type]
