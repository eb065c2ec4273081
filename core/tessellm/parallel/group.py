"""One engine's tensor-parallel group on torch.distributed.

Three process groups, made in the same order on every rank:
- the default group (gloo, `distributed_timeout_s`): joining, start-up agreement (the KV
  block count every rank can hold), the ready barrier;
- the control group (gloo, a week): the leader's `ControlChannel` to the workers. An idle
  worker waits on it for the next step, so it must not time out; a leader that dies closes
  its connections, which the waiting workers see at once;
- the compute groups (the device plugin's `distributed_backend`, `distributed_timeout_s`),
  one per pipeline stage over that stage's ranks (parallel.layout), unless the plugin supplies
  its own Communicator: the graph's all_reduce / all_gather;
- with pipeline stages, the pipe group (the same backend and timeout, every rank): the
  stages' point-to-point sends of hidden states and logits (parallel.pipe).
A collective whose peer is gone raises at once (the connection closes) and one whose peer
is late raises after the timeout: nothing waits forever.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from tessellm.device import Communicator, DevicePlugin
from tessellm.errors import ConfigError, TessellmError
from tessellm.parallel.layout import RankLayout
from tessellm.parallel.messages import ControlMessage, Stop

CONTROL_TIMEOUT = timedelta(days=7)


class ParallelGroupError(TessellmError, RuntimeError):
    """A rank of the tensor-parallel group is gone or out of step: the engine cannot go on."""


@dataclass(slots=True)
class CollectiveStats:
    calls: int = 0
    seconds: float = 0.0   # host time in collectives (enqueue time on an asynchronous device)


class TimedCommunicator(Communicator):
    """Counts the calls and host seconds of another communicator's collectives."""

    def __init__(self, inner: Communicator, stats: CollectiveStats) -> None:
        self.inner, self.stats = inner, stats
        self.rank, self.world_size = inner.rank, inner.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.inner.all_reduce(x)
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - t0
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.inner.all_gather(x, dim)
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - t0
        return out


class TorchCommunicator(Communicator):
    """Collectives of a torch.distributed process group."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


class ControlChannel:
    """Rank 0 to every other rank, in order: a length, then the message's msgpack bytes."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ControlMessage)

    def send(self, message: ControlMessage) -> None:
        data = self._encoder.encode(message)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.group)

    def recv(self) -> ControlMessage:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.group)
        return self._decoder.decode(data.numpy().tobytes())


@dataclass
class ParallelGroup:
    """This process's place in the group; `channel` sends on rank 0 and receives elsewhere.
    `workers` are the worker ranks rank 0 started, child processes or Ray actors (None
    under a launcher).
    `layout`: tensor x pipeline ranks (set by connect_device from the engine config)."""

    rank: int
    world_size: int
    timeout_s: float
    channel: ControlChannel
    workers: object | None = None     # tessellm.parallel.launch.WorkerRanks
    comm: TimedCommunicator | None = None
    stats: CollectiveStats = field(default_factory=CollectiveStats)
    layout: RankLayout = RankLayout()
    pipe_group: dist.ProcessGroup | None = None
    _ready: bool = False
    _closed: bool = False

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank_of(self.rank)

    def connect_device(self, device: DevicePlugin,
                       layout: RankLayout | None = None) -> Communicator:
        """This rank's stage's compute group on `device`, and the pipe group when there are
        several stages (every rank calls this once, after WorkerInit, in the same order)."""
        self.layout = layout or RankLayout(tp=self.world_size)
        if self.layout.world != self.world_size:
            raise ConfigError(f"{self.layout.tp} tensor-parallel x {self.layout.pp} pipeline "
                              f"ranks but the group has {self.world_size}")
        timeout = timedelta(seconds=self.timeout_s)
        comm = None if self.layout.pp > 1 else device.communicator(
            self.rank, self.world_size, self.timeout_s)
        if comm is None:
            require_torch_backend(device)
            for stage in range(self.layout.pp):   # every rank makes every stage's group
                group = dist.new_group(self.layout.stage_ranks(stage),
                                       backend=device.distributed_backend, timeout=timeout)
                if stage == self.stage:
                    comm = TorchCommunicator(group, self.tp_rank, self.layout.tp)
        if self.layout.pp > 1:
            self.pipe_group = dist.new_group(backend=device.distributed_backend,
                                             timeout=timeout)
        self.comm = TimedCommunicator(comm, self.stats)
        return self.comm

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def wait_ready(self) -> None:
        """Every rank has built its shard and chosen its kernels (once; the leader's first
        step waits here, so no collective of a step waits on a rank still profiling)."""
        if not self._ready:
            dist.barrier(group=self.channel.group)
            self._ready = True

    def check_alive(self, grace_s: float = 0.0) -> None:
        """Raise ParallelGroupError if a worker rank rank 0 started has exited (or exits
        within `grace_s`: after a failed step, to name the rank whose death failed it)."""
        if self.workers is not None:
            self.workers.check(grace_s)

    def shutdown(self) -> None:
        """Leader: tell the workers to stop and wait for them; every rank leaves the group."""
        if self._closed:
            return
        self._closed = True
        if self.is_leader:
            try:
                self.channel.send(Stop())
            except Exception:   # a worker already gone: the others see the leader leave
                pass
            if self.workers is not None:
                self.workers.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def require_torch_backend(device: DevicePlugin) -> None:
    """ConfigError unless torch.distributed here can run the device's backend (for a device
    that brings no Communicator of its own)."""
    backend = device.distributed_backend
    if backend not in ("gloo", "nccl", "mpi", "ucc") or not dist.is_backend_available(backend):
        raise ConfigError(f"device {device.name!r} names distributed backend {backend!r}, "
                          "which torch.distributed here cannot run and the plugin supplies "
                          "no communicator of its own")


def join(rank: int, world_size: int, timeout_s: float, store: dist.Store | None = None
         ) -> ParallelGroup:
    """Join the default group (through `store`, else the launcher's env://) and make the
    control group."""
    timeout = timedelta(seconds=timeout_s)
    if store is not None:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    else:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size,
                                timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return ParallelGroup(rank, world_size, timeout_s, ControlChannel(control))
