"""The plugin manager: discovery through entry points, API version check, loud probing."""
from __future__ import annotations

import json
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from tessellm.errors import ConfigError, DeviceUnavailableError
from tessellm.plugin_spec import API_VERSION, ENTRY_POINT_GROUP
from tessellm.plugin_records import PluginRecord
from tessellm.plugins import PluginManager


def ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


def fake(*names: str) -> list[EntryPoint]:
    return [ep(n, f"broken_plugins:{n}") for n in names]


def record(pm: PluginManager, name: str) -> PluginRecord:
    return next(r for r in pm.records if r.name == name)


# -- real entry points -------------------------------------------------------------------

def test_installed_sim_and_cpu_are_discovered_through_entry_points() -> None:
    pm = PluginManager().load()
    sim = record(pm, "sim")
    assert (sim.status, sim.error, sim.value) == ("loaded", None, "tessellm_sim.plugin")
    assert sim.version == "0.1.0"
    assert [(d.name, d.priority, d.available) for d in sim.devices] == [("sim", -10, True)]
    assert record(pm, "cpu").value == "tessellm_cpu.plugin"
    assert pm.select_device("sim").name == "sim"
    ops = pm.kernel_registry().ops("sim")
    assert "silu_and_mul" in ops and "fused_add_rms_norm" not in ops


def test_load_is_idempotent() -> None:
    pm = PluginManager(fake("fast"))
    assert pm.load() is pm
    pm.load()
    assert [r.name for r in pm.records] == ["fast"]


# -- failures are reported, not dropped --------------------------------------------------

def test_plugin_that_raises_on_import_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "explodes_on_import.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = PluginManager([ep("boom", "explodes_on_import"), *fake("fast")]).load()
    boom = record(pm, "boom")
    assert (boom.status, boom.error) == ("error", "RuntimeError: boom at import")
    assert boom.version == "unknown" and boom.devices == []
    assert list(pm.devices()) == ["fast"]


def test_missing_module_is_reported() -> None:
    pm = PluginManager([ep("ghost", "tessellm_no_such_plugin.plugin")]).load()
    rec = record(pm, "ghost")
    assert rec.status == "error"
    assert rec.error is not None and rec.error.startswith("ModuleNotFoundError: ")
    assert "tessellm_no_such_plugin" in rec.error


def test_other_major_or_newer_minor_api_version_is_refused_naming_both_versions() -> None:
    pm = PluginManager(fake("future_api", "no_api", "minor_newer", "minor_older")).load()
    future = record(pm, "future_api")
    assert future.status == "refused"
    assert "2.0" in future.error and API_VERSION in future.error
    no_api = record(pm, "no_api")
    assert no_api.status == "refused" and "no TESSELLM_API_VERSION" in no_api.error
    newer = record(pm, "minor_newer")
    assert newer.status == "refused" and "1.10" in newer.error and API_VERSION in newer.error
    assert "upgrade tessellm" in newer.error
    assert record(pm, "minor_older").status == "loaded"
    assert set(pm.devices()) == {"older"}  # refused plugins' hooks never ran


def test_a_minor_version_older_than_what_the_plugin_implements_is_refused() -> None:
    pm = PluginManager(fake("async_at_1_1", "async_at_1_4", "members_at_1_2", "formats_at_1_4",
                            "overrides_at_1_2")).load()
    too_old = record(pm, "async_at_1_1")
    assert too_old.status == "refused" and too_old.devices == []
    assert ("declares API version 1.1 but implements DevicePlugin.asynchronous (device "
            "'async11') (added in 1.4)") in too_old.error
    assert 'declare TESSELLM_API_VERSION = "1.4" or later' in too_old.error
    assert record(pm, "async_at_1_4").status == "loaded"
    members = record(pm, "members_at_1_2")
    assert members.status == "refused" and "DevicePlugin.communicator" in members.error
    assert "kernels_not_offered" not in members.error   # 1.2 is declared: not listed
    formats = record(pm, "formats_at_1_4")
    assert formats.status == "refused"
    assert "hook tessellm_tool_call_formats (added in 1.5)" in formats.error
    overrides = record(pm, "overrides_at_1_2")
    assert overrides.status == "refused"
    assert "TESSELLM_OVERRIDE_ARCHITECTURES (added in 1.3)" in overrides.error
    assert set(pm.devices()) == {"async14"}   # the refused plugins' devices are not kept


def test_members_tessellm_itself_defines_need_no_newer_version() -> None:
    """DevicePlugin's own defaults (and the classes of the core and its built-in plugins) are
    not the plugin's doing; what a plugin's class defines itself is."""
    from broken_plugins import AsyncFakeDevice, FakeDevice
    from tessellm.plugin_versions import device_needs
    assert device_needs(FakeDevice("plain")) == {}
    assert set(device_needs(AsyncFakeDevice("a"))) == {
        "DevicePlugin.asynchronous (device 'a')"}
    from tessellm_cpu.device import CpuDevice

    class CpuSubclass(CpuDevice):   # inherits the built-in plugin's 1.9 members
        name = "cpu-sub"

    class CpuSubclassOwning(CpuSubclass):
        def prefers_int8_activations(self) -> bool:
            return False
    assert device_needs(CpuSubclass()) == {}
    assert set(device_needs(CpuSubclassOwning())) == {
        "DevicePlugin.prefers_int8_activations (device 'cpu-sub')"}


def test_refused_plugin_is_not_registered() -> None:
    pm = PluginManager(fake("future_api")).load()
    assert pm.devices() == {}
    with pytest.raises(ConfigError, match="future_api"):
        pm.select_device("future")


def test_devices_hook_that_raises_is_an_error() -> None:
    pm = PluginManager(fake("devices_hook_raises")).load()
    rec = record(pm, "devices_hook_raises")
    assert rec.status == "error" and "ValueError: cannot enumerate devices" in rec.error


def test_unknown_hook_name_is_an_error() -> None:
    rec = record(PluginManager(fake("typo_hook")).load(), "typo_hook")
    assert rec.status == "error" and "tessellm_devicez" in rec.error


def test_same_device_name_twice_is_an_error_on_the_second_plugin() -> None:
    pm = PluginManager(fake("fast", "duplicate_fast")).load()
    assert record(pm, "fast").status == "loaded"
    dup = record(pm, "duplicate_fast")
    assert dup.status == "error" and "'fast'" in dup.error and "already provided by plugin 'fast'" in dup.error
    assert pm.devices()["fast"].priority == 100


def test_probe_that_raises_makes_the_device_unavailable_with_the_error() -> None:
    pm = PluginManager(fake("flaky_probe")).load()
    (dev,) = record(pm, "flaky_probe").devices
    assert not dev.available and "RuntimeError: driver exploded" in dev.reason
    with pytest.raises(DeviceUnavailableError, match="driver exploded"):
        pm.select_device("flaky")


# -- selection ---------------------------------------------------------------------------

def test_auto_picks_highest_priority_available_device() -> None:
    pm = PluginManager(fake("slow", "best_but_absent", "fast", "kernels_missing")).load()
    assert pm.select_device("auto").name == "fast"


def test_auto_without_any_available_device_says_why() -> None:
    pm = PluginManager(fake("best_but_absent")).load()
    with pytest.raises(DeviceUnavailableError, match="no best-accelerator found"):
        pm.select_device("auto")


def test_unknown_device_lists_devices_and_failed_plugins() -> None:
    pm = PluginManager([*fake("fast", "slow", "future_api"), ep("ghost", "tessellm_no_such_plugin")]).load()
    with pytest.raises(ConfigError) as info:
        pm.select_device("nope")
    message = str(info.value)
    for expected in ("'nope'", "fast", "slow", "future_api", "2.0", "ghost", "ModuleNotFoundError"):
        assert expected in message


def test_unavailable_device_raises_with_its_reason() -> None:
    pm = PluginManager(fake("best_but_absent")).load()
    assert "best" in pm.devices()  # known, though unavailable
    with pytest.raises(DeviceUnavailableError, match="no best-accelerator found on the PCI bus"):
        pm.select_device("best")


# -- contributions -----------------------------------------------------------------------

def test_device_whose_kernels_fail_to_import_becomes_unavailable() -> None:
    pm = PluginManager(fake("kernels_missing", "fast")).load()
    registry = pm.kernel_registry()
    (dev,) = record(pm, "kernels_missing").devices
    assert not dev.available and "ImportError: No module named 'fancy_kernels'" in dev.reason
    assert not registry.has_op("nokern", "add")
    with pytest.raises(DeviceUnavailableError, match="fancy_kernels"):
        pm.select_device("nokern")


def test_kernels_for_unknown_device_are_reported_and_known_ones_registered_after_the_devices() -> None:
    pm = PluginManager(fake("fast", "extra_kernels", "kernels_hook_raises")).load()
    registry = pm.kernel_registry()
    assert [k.name for k in registry.kernels("fast", "add")] == ["fast_add", "extra_add"]
    extra = record(pm, "extra_kernels")
    assert extra.status == "loaded" and "tpu9000" in extra.error and "tpu_add" in extra.error
    assert "RuntimeError: kernel build failed" in record(pm, "kernels_hook_raises").error
    assert pm.kernel_registry() is registry  # built once: errors recorded once
    assert extra.error.count("tpu9000") == 1


def test_architectures_and_graph_passes_are_merged_first_wins() -> None:
    from broken_plugins import ARCH_A, ARCH_O, PASS_A, PASS_B
    pm = PluginManager(fake("archs_a", "archs_b")).load()
    assert pm.architectures() == {"ToyForCausalLM": ARCH_A, "OtherLM": ARCH_O}
    assert pm.graph_passes() == [PASS_A, PASS_B]
    err = record(pm, "archs_b").error
    assert "'ToyForCausalLM' is already provided by plugin 'archs_a' (refused)" in err
    assert record(pm, "archs_a").error is None


def test_architectures_and_passes_must_have_the_public_types() -> None:
    pm = PluginManager(fake("not_typed")).load()
    assert pm.architectures() == {} and pm.graph_passes() == []
    err = record(pm, "not_typed").error
    assert "'StrLM' is str, not an Architecture (ignored)" in err
    assert "'pass_as_a_string' is not a GraphPass (ignored)" in err


def test_built_in_architecture_and_pass_names_are_refused_and_reported(capsys) -> None:
    from broken_plugins import ARCH_A, ARCH_O
    pm = PluginManager(fake("archs_a", "takes_llama")).load()
    assert pm.architectures() == {"ToyForCausalLM": ARCH_A, "MyLM": ARCH_O}
    assert [p.name for p in pm.graph_passes()] == ["pass_a"]   # archs_a's, not takes_llama's
    err = record(pm, "takes_llama").error
    assert "'LlamaForCausalLM' would override tessellm's built-in one (refused; declare " \
           "TESSELLM_OVERRIDE_ARCHITECTURES = ('LlamaForCausalLM',)" in err
    assert "graph pass 'fuse_qkv' would override the one of 'tessellm' (refused)" in err
    assert "graph pass 'pass_a' would override the one of 'archs_a' (refused)" in err
    row = next(r for r in pm.report() if r["plugin"] == "takes_llama")
    assert "LlamaForCausalLM" in row["error"] and "overrides" not in row


def test_a_declared_override_replaces_the_built_in_and_is_reported() -> None:
    from broken_plugins import ARCH_B
    from tessellm.models.architectures import resolve_architecture
    pm = PluginManager(fake("overrides_llama", "bad_override_decl")).load()
    assert pm.architectures() == {"LlamaForCausalLM": ARCH_B}
    assert resolve_architecture({"architectures": ["LlamaForCausalLM"]},
                                pm.architectures()) is ARCH_B
    assert record(pm, "overrides_llama").error is None
    rows = {r["plugin"]: r for r in pm.report()}
    assert rows["overrides_llama"]["overrides"] == ["architecture LlamaForCausalLM"]
    assert "is not a tuple of architecture names" in rows["bad_override_decl"]["error"]
    assert "already provided by plugin 'overrides_llama'" in rows["bad_override_decl"]["error"]


def test_a_kernel_that_would_override_a_registered_name_is_refused() -> None:
    pm = PluginManager(fake("fast", "overrides_cpu_kernel")).load()
    registry = pm.kernel_registry()
    assert [k.name for k in registry.kernels("fast", "add")] == ["fast_add", "own_add"]
    err = record(pm, "overrides_cpu_kernel").error
    assert ("kernel 'fast_add' for op 'add' on device 'fast' would override the one plugin "
            "'fast' registered (refused") in err


def test_report_is_json_and_shows_every_plugin() -> None:
    pm = PluginManager([*fake("fast", "future_api", "flaky_probe"), ep("ghost", "tessellm_no_such_plugin")])
    rows = json.loads(json.dumps(pm.report()))
    by_name = {row["plugin"]: row for row in rows}
    assert set(by_name) == {"fast", "future_api", "flaky_probe", "ghost"}
    assert by_name["fast"]["devices"] == [{"name": "fast", "priority": 100, "available": True, "reason": "",
                                         "distributed_backend": "gloo"}]
    assert by_name["future_api"]["status"] == "refused"
    assert by_name["ghost"]["status"] == "error"
    assert by_name["flaky_probe"]["devices"][0]["available"] is False
    assert set(rows[0]) == {"plugin", "value", "version", "status", "error", "devices"}


def test_speculative_proposers_first_wins_and_built_in_names_are_refused() -> None:
    from broken_plugins import _other_factory, _proposer_factory
    pm = PluginManager(fake("proposers_a", "proposers_b")).load()
    assert pm.speculative_proposers() == {"mine": _proposer_factory, "other": _other_factory}
    err_a, err_b = record(pm, "proposers_a").error, record(pm, "proposers_b").error
    assert "speculative proposer 'ngram' would override the one of 'tessellm' (refused)" in err_a
    assert "speculative proposer 'broken': 'not a factory' is not a callable factory " \
        "(ignored)" in err_a
    assert "speculative proposer 'mine' would override the one of 'proposers_a' (refused)" \
        in err_b
