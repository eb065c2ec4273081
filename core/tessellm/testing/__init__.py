"""tessellm's device conformance kit: `tessellm conformance --device NAME`, and a pytest plugin.

Programmatic use: `run_conformance("mychip").passed`, `.table()`, `.to_json()`.

In a vendor's CI, one test per check:

    # conftest.py (root)                 # tests/test_tessellm_conformance.py
    pytest_plugins = ["tessellm.testing"]    from tessellm.testing import test_conformance

    pytest --tessellm-device mychip [--tessellm-model path/to/stories260K-hf]
           [--tessellm-skip end_to_end]

or, without registering the plugin, in the test module itself:

    from tessellm.testing import pytest_generate_tests, test_conformance
    TESSELLM_DEVICES = ["mychip"]

The hooks import nothing from pytest at module level, so importing this package never needs it.
Beside the kit: `hostile_requests` (a catalogue of hostile HTTP requests and the answers a
server owes them) and `raw_http` (sending them), used by the server tests and `bench soak`.
"""
from __future__ import annotations

from typing import Any

from tessellm.errors import TessellmError
from tessellm.testing.kernel_checks import CheckFailed
from tessellm.testing.results import CheckResult, ConformanceReport
from tessellm.testing.suite import GROUPS, Check, plan_checks, run_checks, run_conformance

__all__ = ["GROUPS", "Check", "CheckFailed", "CheckResult", "ConformanceReport", "plan_checks",
           "run_checks", "run_conformance", "pytest_addoption", "pytest_generate_tests",
           "test_conformance"]

_PARAMETRIZED = "_tessellm_conformance_parametrized"


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("tessellm", "tessellm device conformance")
    group.addoption("--tessellm-device", action="append", default=[],
                    help="device to run the conformance checks on (repeatable)")
    group.addoption("--tessellm-model", default=None,
                    help="a model directory with reference_greedy.json: one more end-to-end "
                         "check beside the built-in demo model's")
    group.addoption("--tessellm-skip", action="append", default=[],
                    help="a check group to skip, reported as skipped (repeatable)")


def _unplannable(device: str, message: str) -> Check:
    def fail() -> str:
        raise CheckFailed(message)
    return Check("plan", "availability", fail)


def pytest_generate_tests(metafunc: Any) -> None:
    """Parametrizes `tessellm_check` over every check of the chosen devices: --tessellm-device,
    else the test module's TESSELLM_DEVICES. Runs once per test even when both the plugin and
    a module import of this hook are active."""
    if "tessellm_check" not in metafunc.fixturenames or getattr(metafunc.definition, _PARAMETRIZED, False):
        return
    import pytest

    from tessellm.plugins import PluginManager
    setattr(metafunc.definition, _PARAMETRIZED, True)
    devices = list(metafunc.config.getoption("tessellm_device", default=None) or
                   getattr(metafunc.module, "TESSELLM_DEVICES", None) or [])
    if not devices:
        raise pytest.UsageError("tessellm conformance: no device; pass --tessellm-device NAME "
                                "or set TESSELLM_DEVICES in the test module")
    model = (metafunc.config.getoption("tessellm_model", default=None)
             or getattr(metafunc.module, "TESSELLM_MODEL", None))
    skip = metafunc.config.getoption("tessellm_skip", default=None) or []
    manager = PluginManager().load()
    params = []
    for name in devices:
        try:
            checks = plan_checks(name, manager, model, skip=skip)
        except TessellmError as exc:   # an unknown device is a failing test, not a crash
            checks = [_unplannable(name, f"{type(exc).__name__}: {exc}")]
        params += [pytest.param(c, id=f"{name}:{c.name}") for c in checks]
    metafunc.parametrize("tessellm_check", params)


def test_conformance(tessellm_check: Check) -> None:
    """One conformance check; its failure message is the check's detail (a check the user
    opted out of is a pytest skip)."""
    result = tessellm_check.result()
    if result.result == "SKIP":
        import pytest
        pytest.skip(result.detail)
    if not result.passed:
        raise AssertionError(f"{result.check}: {result.detail}")
