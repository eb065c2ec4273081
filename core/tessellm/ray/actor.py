"""The engine core as a Ray actor.

One actor per replica. `run(inbox, outbox)` is the engine core of one incarnation: it
connects to the front end's tcp sockets, builds the engine, sends Ready and runs the core loop
until Shutdown (engine_core.run_core, publishing its prefix cache's block hashes); it returns
None, or raises EngineCoreError when the core failed to start or its loop died. The call
blocks the actor for the incarnation's life, so the front end sees the core's death as that
call's failure (RayActorError when the process died). Ray restarts a dead actor (the
`max_restarts` it was created with); a restarted one waits for the front end's next `run`.
"""
from __future__ import annotations

import logging


class EngineCoreActor:
    """Decorated with ray.remote by `actor_class` (Ray is imported only there)."""

    def __init__(self, config_json: str, name: str) -> None:
        self.config_json = config_json
        self.name = name

    def run(self, inbox_addr: str, outbox_addr: str) -> None:
        from tessellm.engine.core_client import EngineCoreError
        from tessellm.engine.engine_core import run_core
        logging.basicConfig(level=logging.INFO,
                            format=f"%(levelname)s %(name)s[{self.name}]: %(message)s")
        error = run_core(self.config_json, inbox_addr, outbox_addr, None, publish_blocks=True)
        if error is not None:
            raise EngineCoreError(f"{self.name}: {error}")


def actor_class(ray, num_cpus: int, max_restarts: int):   # noqa: ANN001, ANN201 (ray's types)
    """EngineCoreActor as a Ray actor class taking `num_cpus` CPUs, restarted up to
    `max_restarts` times after its process dies (a task in flight then is not retried)."""
    return ray.remote(num_cpus=num_cpus, max_restarts=max_restarts,
                      max_task_retries=0)(EngineCoreActor)
