"""SchedulerConfig: the scheduler's limits and policies, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass

from tessellm.errors import ConfigError
from tessellm.scheduling.request_scheduler import MAX_PRIORITY_LEVELS
from tessellm.scheduling.sla import SLAConfig

DEFAULT_PRIORITY_LEVELS = 3
DEFAULT_AGING_INTERVAL_STEPS = 500


@dataclass(slots=True)
class SchedulerConfig:
    """priority_levels: request priorities are 0 (most urgent) .. priority_levels - 1.
    aging_interval_steps: steps per level of aging (0: no aging; low priority may starve).
    sla: the SLA batch-sizing policy (None: off, the cap is max_num_seqs).
    preemption_mode: "recompute" or "swap"; num_host_blocks: the host pool for swap mode.
    max_loras: with LoRA, at most this many distinct adapters run at once (the device's
    slot table); 0 when the engine serves no adapter."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    priority_levels: int = DEFAULT_PRIORITY_LEVELS
    aging_interval_steps: int = DEFAULT_AGING_INTERVAL_STEPS
    sla: SLAConfig | None = None
    preemption_mode: str = "recompute"
    num_host_blocks: int = 0
    max_loras: int = 0   # LoRA: most distinct adapters among running requests (0: no LoRA)

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ConfigError(f"preemption_mode must be 'recompute' or 'swap', got "
                              f"{self.preemption_mode!r}")
        h = self.num_host_blocks
        if not isinstance(h, int) or isinstance(h, bool) or h < 0:
            raise ConfigError(f"num_host_blocks must be an integer >= 0, got {h!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        p = self.priority_levels
        if not isinstance(p, int) or not 1 <= p <= MAX_PRIORITY_LEVELS:
            raise ConfigError(
                f"priority_levels must be an integer in 1..{MAX_PRIORITY_LEVELS}, got {p!r}")
        a = self.aging_interval_steps
        if not isinstance(a, int) or a < 0:
            raise ConfigError(f"aging_interval_steps must be an integer >= 0, got {a!r}")
        if self.sla is not None and not isinstance(self.sla, SLAConfig):
            raise ConfigError(f"sla must be an SLAConfig or None, got {self.sla!r}")
        if self.sla is not None and self.sla.min_num_seqs > self.max_num_seqs:
            raise ConfigError(f"sla.min_num_seqs {self.sla.min_num_seqs} exceeds max_num_seqs "
                              f"{self.max_num_seqs}")
