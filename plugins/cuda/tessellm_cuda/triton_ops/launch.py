"""A Triton kernel launch decided before it runs.

Every host function of `triton_ops` builds its launches as `Launch` records (kernel, grid,
arguments, constexprs and the num_warps / num_stages options), then runs them. The records
are the single source of what is launched: the ahead-of-time compile check
(`tessellm_cuda.triton_ops.aot`) builds them the same way from meta tensors and compiles
exactly those for GPU targets, with no GPU and nothing run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Launch:
    """kernel[grid](*args, **kwargs). `kwargs` holds the constexprs and Triton's launch
    options; `args` the runtime arguments in the kernel's order."""

    kernel: Any                     # a triton JITFunction (or the interpreter's stand-in)
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


def run_all(launches: list[Launch]) -> None:
    """Runs the launches in order."""
    for launch in launches:
        launch.run()
