"""`tessellm bench ... --plot FILE.png`: the figures drawn with matplotlib, the target checked
before a benchmark runs, and a clear error where matplotlib is missing."""
from __future__ import annotations

import builtins
import json

import pytest

from tessellm.cli.bench_report import check_plot_target, plot_result
from tessellm.cli.main import main
from tessellm.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_latency_draws_its_runs_and_profile(capsys, stories_dir, tmp_path):
    target = tmp_path / "w3.png"
    assert main(["bench", "latency", "--model", str(stories_dir), "--input-len", "20",
                 "--output-len", "4", "--dtype", "float32", "--runs", "2", "--profile",
                 "--plot", str(target)]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert len(result["prefill_tok_per_s_runs"]) == 2 == len(result["decode_tok_per_s_runs"])
    assert str(target) in err
    assert target.read_bytes()[:8] == PNG_MAGIC and target.stat().st_size > 5000


def test_serving_percentiles_are_drawn(tmp_path):
    result = {"workload": "W2", "ttft_ms": {"p50": 60.0, "p90": 90.0, "p99": 120.0},
              "tpot_ms": {"p50": 25.0, "p90": 28.0, "p99": 31.0}}
    assert plot_result(result, tmp_path / "w2.png").read_bytes()[:8] == PNG_MAGIC


def test_a_result_without_figures_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no figures"):
        plot_result({"workload": "W1"}, tmp_path / "x.png")


@pytest.mark.parametrize("name, why", [("plot.svg", "PNG"), ("missing/plot.png", "does not exist")])
def test_bad_targets_are_refused_before_anything_runs(tmp_path, name, why):
    with pytest.raises(ConfigError, match=why):
        check_plot_target(str(tmp_path / name))


def test_without_matplotlib_plot_is_a_clear_error(monkeypatch, tmp_path, capsys, stories_dir):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    # refused at once (exit 2, no traceback), before the model is even loaded
    assert main(["bench", "latency", "--model", str(stories_dir / "absent"),
                 "--plot", str(tmp_path / "w.png")]) == 2
    assert "pip install 'tessellm[plot]'" in capsys.readouterr().err
