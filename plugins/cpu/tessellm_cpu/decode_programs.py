"""The CPU device's decode programs: which decode batch sizes run as native programs and the
object `CpuDevice.compile` returns for each (tessellm_cpu.native_program records and replays
them).

The engine pads a decode step to the smallest declared size that holds it (padding rows are
decodes over the null block whose tokens are dropped) and passes the same input buffers on
every step of a size, as it does for CUDA graphs. Sizes: 1 to 8 exactly (one stream, a few
streams, and one stream's speculative verify steps of 1 + k rows: padding a 5-row verify step
to 8 rows made its linears cost 8 rows), then every multiple of 4 up to 16, then of 8, and
max_num_seqs itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from tessellm.plugin_api import ExecutionPlan
from tessellm_cpu.native_build import NativeBuildError
from tessellm_cpu.native_program import NativeProgram, feed_pointers, record_program
from tessellm_cpu.program_runtime import NotRecordable, ProgramRecorder, ProgramRunner

log = logging.getLogger(__name__)


def program_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16) if s <= max_num_seqs]
    sizes += list(range(24, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


class DecodePrograms:
    """One per CPU device: the recorder its native kernels consult, the program runner and
    the native select_rows (built with the kernels; None and the reason when they cannot
    be built, and then decode steps run eagerly)."""

    def __init__(self) -> None:
        self.recorder = ProgramRecorder()
        self.runner: ProgramRunner | None = None
        self.select_rows: Callable[..., Any] | None = None
        self.unavailable: str | None = None

    def build(self) -> str | None:
        """Build the runner (once); returns why it cannot be had, or None."""
        if self.runner is not None or self.unavailable is not None:
            return self.unavailable
        from tessellm_cpu.native_token_ops import NativeSelectRows
        try:
            runner, select = ProgramRunner(), NativeSelectRows()
        except NativeBuildError as e:
            self.unavailable = str(e)
            log.warning("tessellm_cpu: native programs unavailable, decode steps run eagerly: "
                        "%s", e)
            return self.unavailable
        select.recorder = self.recorder
        self.runner, self.select_rows = runner, select
        self.recorder.runner = runner
        return None

    def batch_sizes(self, max_num_seqs: int) -> list[int]:
        return [] if self.build() else program_batch_sizes(max_num_seqs)

    def program(self, plan: ExecutionPlan) -> "DecodeProgram":
        if self.build() or self.runner is None:
            raise NativeBuildError(f"native programs are unavailable: {self.unavailable}")
        return DecodeProgram(plan, self.recorder, self.runner, self.select_rows)


@dataclass
class DecodeProgram:
    """What `CpuDevice.compile` returns for a DecodeGraphShape: the plan's `run(feeds)`,
    recording a NativeProgram on the first call and again when an input buffer moved or a
    kernel choice of the plan changed; eager (with a warning) if the plan cannot be
    recorded."""

    plan: ExecutionPlan
    recorder: ProgramRecorder
    runner: ProgramRunner
    select_rows: Callable[..., Any] | None
    program: NativeProgram | None = None
    profile_sink: Any = None     # a PlanProfileSink while `bench --profile` runs
    recordings: int = 0
    eager_reason: str | None = None
    _warned: bool = field(default=False, repr=False)

    def run(self, feeds: dict[str, Any]) -> Any:
        if self.eager_reason is not None:
            return self.plan.run(feeds)
        p = self.program
        if p is not None and p.generation == self.plan.kernel_generation \
                and p.pointers == feed_pointers(feeds):
            return p.run(feeds, self.profile_sink)
        self.program = None
        try:
            program, output = record_program(self.plan, feeds, self.recorder, self.runner,
                                             self.select_rows)
        except NotRecordable as e:
            self.eager_reason = str(e)
            log.warning("tessellm_cpu: decode steps of this shape run eagerly: %s", e)
            return self.plan.run(feeds)
        self.recordings += 1
        self.program = program
        if program.fallbacks and not self._warned:
            self._warned = True
            log.info("tessellm_cpu: native program with %d Python node(s): %s",
                     program.python_calls,
                     "; ".join(f"{k}: {v}" for k, v in list(program.fallbacks.items())[:4]))
        return output
