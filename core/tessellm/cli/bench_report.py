"""What `tessellm bench throughput|latency|serve` show besides their JSON line: a progress bar
on stderr (tqdm; hidden when stderr is not a terminal, so piped JSON stays clean) and, with
`--plot FILE.png`, the figures drawn with matplotlib (an optional dependency:
`pip install 'tessellm[plot]'`; without it `--plot` is refused before anything runs).

A plot holds one panel per figure family of the result: the timed runs and their median
(throughput: generated tok/s; latency: prefill and decode tok/s), serving percentiles (TTFT and
TPOT p50/p90/p99), and, when the result has a profile, milliseconds per step by op kind (a
compiled step's kernels) beside its host time (crossings, barriers, and the engine's stages
outside the forward pass: scheduling, inputs, sampling, bookkeeping).
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from tessellm.errors import ConfigError


def progress(total: int, desc: str):
    """A tqdm bar over `total` units on stderr; disabled where stderr is not a terminal."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=None, leave=False)


def check_plot_target(path: str | None) -> Path | None:
    """The PNG path to draw into, checked before a benchmark spends minutes running."""
    if path is None:
        return None
    target = Path(path)
    if target.suffix.lower() != ".png":
        raise ConfigError(f"--plot writes a PNG file; {path!r} does not end in .png")
    if not target.parent.is_dir():
        raise ConfigError(f"--plot: directory {str(target.parent)!r} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ConfigError("--plot needs matplotlib: pip install 'tessellm[plot]'") from e
    return target


def _runs_panels(result: dict[str, Any]) -> list[tuple[str, str, list[float]]]:
    """(title, unit, per-run values) for each per-run figure the result carries."""
    names = {"gen_tok_per_s_runs": "generated tokens / s",
             "prefill_tok_per_s_runs": "prefill tokens / s",
             "decode_tok_per_s_runs": "decode tokens / s"}
    return [(title, "tok/s", result[key]) for key, title in names.items() if result.get(key)]


def _percentile_panels(result: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    return [(f"{name} (ms)", result[key]) for key, name in (("ttft_ms", "TTFT"),
                                                              ("tpot_ms", "TPOT"))
            if isinstance(result.get(key), dict)]


def plot_result(result: dict[str, Any], target: Path) -> Path:
    """Draw `result` (one bench JSON object) into `target`; returns it. Raises ConfigError if
    the result has no figure to draw."""
    import matplotlib
    matplotlib.use("Agg")   # files only: no display needed
    import matplotlib.pyplot as plt

    runs, pcts = _runs_panels(result), _percentile_panels(result)
    ops = (result.get("profile") or {}).get("ops") or {}
    count = len(runs) + len(pcts) + (1 if ops else 0)
    if count == 0:
        raise ConfigError("--plot: this result has no figures to draw")
    fig, axes = plt.subplots(1, count, figsize=(4.2 * count, 3.6), squeeze=False)
    panels = iter(axes[0])
    for title, unit, values in runs:
        ax = next(panels)
        ax.bar([f"run {i + 1}" for i in range(len(values))], values, color="#4c78a8")
        med = statistics.median(values)
        ax.axhline(med, color="#e45756", linestyle="--", label=f"median {med:.1f}")
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.legend(loc="lower right")
    for title, values in pcts:
        ax = next(panels)
        ax.bar(list(values), list(values.values()), color="#72b7b2")
        ax.set_title(title)
        ax.set_ylabel("ms")
    if ops:
        ax = next(panels)
        profile = result["profile"]
        host = {f"host: {k}": v for k, v in (profile.get("host_ms_per_step") or {}).items()}
        host.update({f"host: {k}": v for k, v in (profile.get("stages_ms_per_step") or {}).items()
                     if k != "execute" and v})
        kinds = list(ops)[::-1]   # the report sorts by time; the largest goes on top
        ax.barh(kinds, [ops[k]["ms_per_step"] for k in kinds], color="#f58518", label="kernels")
        if host:
            names = sorted(host, key=host.get)
            ax.barh(names, [host[k] for k in names], color="#9d9da1", label="host")
            ax.legend(loc="lower right", fontsize=7)
        ax.set_title("where a step goes")
        ax.set_xlabel("ms per step")
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(_caption(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def _caption(result: dict[str, Any]) -> str:
    parts = [result.get("workload", "bench"), result.get("model"), result.get("device"),
             result.get("dtype")]
    return " · ".join(str(p) for p in parts if p)
