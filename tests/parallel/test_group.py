"""The tensor-parallel group's device seam (tessellm.parallel.group.ParallelGroup): a device
plugin may supply its own Communicator, which the group then uses (timed); a device whose
backend torch.distributed cannot run and that supplies none is refused with a clear error."""
from __future__ import annotations

import pytest
import torch

from tessellm.errors import ConfigError
from tessellm.plugin_api import Communicator
from tessellm.parallel.group import ParallelGroup
from tessellm_sim.device import SimDevice


class Doubling(Communicator):
    """A fake two-rank group whose other rank always holds the same tensor."""

    rank, world_size = 0, 2

    def all_reduce(self, x):
        return x * 2

    def all_gather(self, x, dim):
        return torch.cat([x, x], dim=dim)


class OwnCollectives(SimDevice):
    distributed_backend = "vendor-link"

    def communicator(self, rank, world_size, timeout_s):
        return Doubling()


class NoCollectives(SimDevice):
    distributed_backend = "xla"


def _group() -> ParallelGroup:
    return ParallelGroup(rank=0, world_size=2, timeout_s=5.0, channel=None)


def test_a_plugins_communicator_is_used_and_timed():
    group = _group()
    comm = group.connect_device(OwnCollectives())
    x = torch.ones(3)
    assert torch.equal(comm.all_reduce(x), torch.full((3,), 2.0))
    assert comm.all_gather(torch.ones(2, 1), -1).shape == (2, 2)
    assert group.stats.calls == 2 and group.stats.seconds > 0


def test_a_backend_torch_cannot_run_without_a_communicator_is_refused():
    with pytest.raises(ConfigError, match="distributed backend 'xla'.*no communicator"):
        _group().connect_device(NoCollectives())


def test_the_engine_refuses_such_a_device_before_starting_any_worker(stories_dir, monkeypatch):
    """tensor_parallel_size=2 on a device with backend 'xla' and no communicator: the error
    comes from the builder, before a worker process or a process group exists."""
    from tessellm import LLM
    from tessellm.parallel import launch
    import torch.distributed as dist

    def no_workers(*a, **k):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch.LocalWorkers, "spawn", no_workers)
    monkeypatch.setattr("tessellm_sim.device.SimDevice.distributed_backend", "xla")
    with pytest.raises(ConfigError, match="distributed backend 'xla'"):
        LLM(str(stories_dir), device="sim", dtype="float32", tensor_parallel_size=2,
            load_progress=False)
    assert not dist.is_initialized()
