"""The kit stands alone: its end-to-end check runs the built-in demo model against tokens
shipped in the package, so `tessellm conformance --device NAME` needs no argument. The stored
tokens equal transformers' greedy output on the same weights (the file cannot go stale), the
check fails on other tokens, and only a user's opt-out (`--skip`) turns checks into SKIP."""
from __future__ import annotations

import json
from importlib.metadata import EntryPoint

import pytest

import planted_plugins
from tessellm.cli.main import main
from tessellm.models.demo import DEMO_FORMAT_VERSION, ensure_demo_model
from tessellm.plugin_spec import ENTRY_POINT_GROUP
from tessellm.plugins import PluginManager
from tessellm.testing import plan_checks, run_conformance
from tessellm.testing import demo_reference
from tessellm.testing.demo_reference import load_reference, record_reference, weights_sha256


@pytest.fixture(scope="module")
def planted() -> PluginManager:
    return PluginManager([EntryPoint(name="good", value="planted_plugins:good",
                                     group=ENTRY_POINT_GROUP)]).load()


def test_the_shipped_tokens_are_transformers_greedy_output_on_the_demo_weights(tmp_path) -> None:
    stored = load_reference()
    fresh = record_reference(ensure_demo_model(tmp_path / "demo"), stored["prompt"],
                             stored["max_new_tokens"])
    assert stored["demo_format_version"] == DEMO_FORMAT_VERSION
    assert stored["weights_sha256"] == fresh["weights_sha256"] == weights_sha256()
    assert stored["token_ids"] == fresh["token_ids"], (
        "demo_reference.json is stale: run scripts/record_conformance_reference.py")
    # far from a tie, so a device's float32 rounding cannot flip a greedy choice
    assert fresh["min_top2_margin"] > 1e-3


def test_the_reference_ships_in_the_package() -> None:
    import tomllib
    from pathlib import Path
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["tessellm.testing"]
    assert any(demo_reference.REFERENCE_PATH.match(g) for g in globs)


def test_without_a_model_the_demo_check_runs_and_passes(planted, monkeypatch) -> None:
    monkeypatch.delenv("TESSELLM_CONFORMANCE_MODEL", raising=False)
    names = [c.name for c in plan_checks("planted-good", planted)]
    assert "end_to_end.demo" in names and "end_to_end.stories260K" not in names
    report = run_conformance("planted-good", planted, groups=["end_to_end"])
    assert report.passed, report.table()
    assert "24 greedy tokens equal the reference" in report.result("end_to_end.demo").detail


def test_other_reference_tokens_fail_the_demo_check(planted, monkeypatch) -> None:
    wrong = load_reference()
    wrong["token_ids"] = wrong["token_ids"][:-1] + [(wrong["token_ids"][-1] + 1) % 256]
    monkeypatch.setattr(demo_reference, "load_reference", lambda: wrong)
    report = run_conformance("planted-good", planted, groups=["end_to_end"])
    assert not report.passed
    detail = report.result("end_to_end.demo").detail
    assert "greedy tokens differ from demo_reference.json at position 40" in detail


def test_other_weights_than_the_recorded_ones_fail_naming_the_script(planted, monkeypatch) -> None:
    monkeypatch.setattr(demo_reference, "load_reference",
                        lambda: {**load_reference(), "weights_sha256": "0" * 64})
    detail = run_conformance("planted-good", planted, groups=["end_to_end"]).result(
        "end_to_end.demo").detail
    assert "recorded on other demo weights" in detail
    assert "record_conformance_reference.py" in detail


def test_a_named_model_without_its_reference_fails(planted, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TESSELLM_CONFORMANCE_MODEL", str(tmp_path))
    report = run_conformance("planted-good", planted, groups=["end_to_end"], skip=[])
    detail = report.result("end_to_end.stories260K").detail
    assert not report.passed and "holds no reference_greedy.json" in detail


def test_cli_needs_no_argument_but_the_device_and_skips_only_on_request(planted, monkeypatch,
                                                                        capsys) -> None:
    monkeypatch.delenv("TESSELLM_CONFORMANCE_MODEL", raising=False)
    monkeypatch.setattr("tessellm.testing.suite.PluginManager", lambda: planted)
    assert main(["conformance", "--device", "planted-good", "--checks", "streams,end_to_end",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["check"]: r["result"] for r in rows["results"]}["end_to_end.demo"] == "PASS"
    assert main(["conformance", "--device", "planted-good", "--checks", "streams,end_to_end",
                 "--skip", "end_to_end"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("end_to_end.demo"))
    assert "SKIP" in line and "skipped at the user's request" in line
    assert out.splitlines()[-1].endswith("0 failed, 1 skipped")


def test_availability_and_unknown_groups_cannot_be_skipped(planted) -> None:
    from tessellm.errors import ConfigError
    with pytest.raises(ConfigError, match="availability check cannot be skipped"):
        plan_checks("planted-good", planted, skip=["availability"])
    with pytest.raises(ConfigError, match="unknown conformance group"):
        plan_checks("planted-good", planted, skip=["end2end"])
