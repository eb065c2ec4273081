"""The kit fails, naming the check, on devices with one planted defect each, and passes the
same device without it (planted_plugins.good): the failure is the defect's, not the kit's."""
from __future__ import annotations

import json
from importlib.metadata import EntryPoint

import pytest

import planted_plugins
from tessellm.cli.main import main
from tessellm.plugin_spec import ENTRY_POINT_GROUP
from tessellm.plugins import PluginManager
from tessellm.testing import ConformanceReport, run_conformance


@pytest.fixture(scope="module")
def planted() -> PluginManager:
    return PluginManager([EntryPoint(name=n, value=f"planted_plugins:{n}", group=ENTRY_POINT_GROUP)
                          for n in planted_plugins.ALL]).load()


def _failed(report: ConformanceReport) -> dict[str, str]:
    return {r.check: r.detail for r in report.failed()}


def test_the_control_device_passes_everything(planted, stories_dir) -> None:
    report = run_conformance("planted-good", planted, stories_dir)
    assert report.passed, report.table()
    names = {r.check for r in report.results}
    assert {"allocator.accounting", "stream.copy_event", "kernel:linear/planted-good_linear",
            "kernel:attention_decode/planted-good_attention_decode",
            "end_to_end.demo", "end_to_end.stories260K"} <= names


def test_a_kernel_off_by_a_small_factor_fails_its_kernel_check(planted, stories_dir) -> None:
    report = run_conformance("planted-scaled-linear", planted, stories_dir)
    failed = _failed(report)
    detail = failed["kernel:linear/planted-scaled-linear_linear"]
    assert "differ from the reference" in detail and "float32" in detail
    assert not report.passed and list(failed) == ["kernel:linear/planted-scaled-linear_linear"]
    # 0.1% leaves the greedy tokens as they are: only the kernel check sees it
    assert report.result("end_to_end.stories260K").passed
    assert report.result("end_to_end.demo").passed


def test_attention_that_drops_the_last_cached_token_fails(planted) -> None:
    report = run_conformance("planted-drops-last-token", planted, groups=["kernels"])
    failed = _failed(report)
    assert list(failed) == ["kernel:attention_decode/planted-drops-last-token_attention_decode"]
    assert "cases differ from the reference" in next(iter(failed.values()))


def test_a_stream_whose_events_lie_fails_the_stream_checks(planted) -> None:
    report = run_conformance("planted-lying-stream", planted, groups=["streams"])
    failed = _failed(report)
    assert "stream.copy_event" in failed and "stream.record_event" in failed
    assert "the event completed before the copy" in failed["stream.copy_event"]
    assert set(failed) <= {r.check for r in report.results if r.check.startswith("stream.")}


def test_an_allocator_that_does_not_account_fails(planted) -> None:
    report = run_conformance("planted-no-accounting", planted, groups=["allocator"])
    failed = _failed(report)
    assert "allocated_bytes went" in failed["allocator.accounting"]
    assert "was not refused" in failed["allocator.capacity"]
    assert "allocator.upload" in failed


def test_cli_exits_1_and_names_the_failed_check(planted, monkeypatch, capsys) -> None:
    monkeypatch.setattr("tessellm.testing.suite.PluginManager", lambda: planted)
    assert main(["conformance", "--device", "planted-lying-stream", "--checks", "streams"]) == 1
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("stream.copy_event"))
    assert "FAIL" in line and "had not landed" in line
    assert "conformance FAILED" in out.splitlines()[-1]
    assert main(["conformance", "--device", "planted-good", "--checks", "streams,allocator",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows["passed"] and rows["device"] == "planted-good"
    assert {r["check"] for r in rows["results"]} >= {"availability", "stream.query",
                                                     "allocator.capacity"}
    assert all(r["result"] == "PASS" for r in rows["results"])
