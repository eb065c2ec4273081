"""Start-up progress lines on stderr: `tessellm: [2.31 s] choosing kernels ...`, the seconds
counted from the start of the process that the user launched (the server, when an engine core
process reports), so the lines of both processes read as one timeline.

Invariant: a line is printed only when enabled, and never raises (a clock that cannot be read
falls back to the time this object was made).
"""
from __future__ import annotations

import os
import sys
import time


def process_start_time(pid: int) -> float | None:
    """Wall-clock time (epoch seconds) at which process `pid` started, to a clock tick: its
    age from /proc (start tick and uptime share the boot clock); None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as fh:
            uptime = float(fh.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")   # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - max(0.0, age)


class StartupProgress:
    def __init__(self, enabled: bool = True, origin_pid: int | None = None) -> None:
        """origin_pid: the process whose start is second 0 (default: this one)."""
        self.enabled = enabled
        self.origin = process_start_time(origin_pid or os.getpid()) or time.time()

    def elapsed(self) -> float:
        return max(0.0, time.time() - self.origin)

    def stage(self, text: str) -> None:
        if self.enabled:
            print(f"tessellm: [{self.elapsed():.2f} s] {text}", file=sys.stderr, flush=True)
