"""`tessellm bench startup`: cold and warm starts of a real server (stories260K's GGUF), each
to /health 200, with the server's stage timeline. A cold start profiles kernels and builds the
tokenizer; a warm one reuses both from the cache the cold runs left (no profiling line)."""
from __future__ import annotations

import json

from tessellm.cli.main import main

STORIES_GGUF = "../shared/models/stories260K/stories260K.gguf"


def test_cold_and_warm_starts_are_timed_with_their_stages(capsys):
    assert main(["bench", "startup", "--model", STORIES_GGUF, "--runs", "1",
                 "--serve-args", "--dtype float32 --threads 1 --max-num-seqs 2 "
                                 "--max-num-batched-tokens 32"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    for kind in ("cold", "warm"):
        r = report[kind]
        assert len(r["all_s"]) == 1 and r["median_s"] > 0
        stages = [what for _, what in r["stages_of_median_run"]]
        assert stages[0] == "starting the engine core"
        assert any(s.startswith("engine core: ready") for s in stages)
        times = [t for t, _ in r["stages_of_median_run"]]
        assert all(0 <= t <= r["median_s"] + 0.5 for t in times)
    assert any(s.startswith("profiled kernels") for _, s in report["cold"]["stages_of_median_run"])
    assert not any(s.startswith("profiled kernels")
                   for _, s in report["warm"]["stages_of_median_run"])
