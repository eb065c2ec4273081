"""Starting an engine's tensor-parallel group from rank 0 (the engine's own process).

Under a launcher (torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, one process per
rank, possibly on several machines) rank 0 joins the ranks the launcher started; ranks > 0 run
`python -m tessellm.parallel.worker` (the `tessellm` CLI turns itself into one). Otherwise
rank 0 starts the other ranks itself over a TCP store it serves: as local processes
(`LocalWorkers`, the "mp" backend, on loopback) or as Ray actors in a placement group
(`parallel.ray_workers.RayWorkers`, the "ray" backend), and watches them: a worker that
exits is seen by `check` before the next step, and a worker whose leader is gone exits by
itself. Rank 0 then sends every worker the engine config (`WorkerInit`).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from tessellm.config import EngineConfig
from tessellm.errors import ConfigError
from tessellm.parallel.group import ParallelGroup, ParallelGroupError, join
from tessellm.parallel.launcher_env import launcher_environment
from tessellm.parallel.layout import RankLayout
from tessellm.parallel.messages import WorkerInit

log = logging.getLogger(__name__)
LEADER_PID_ENV = "TESSELLM_TP_LEADER_PID"
JOINED_KEY = "tessellm/joined/{rank}"


class WorkerRanks:
    """The worker ranks 1 .. world-1 rank 0 started: `check` raises ParallelGroupError naming
    one that is gone, `stop` waits for them after Stop (and ends them past its timeout),
    `kill` ends them at once."""

    layout: RankLayout

    def check(self, grace_s: float = 0.0) -> None:
        raise NotImplementedError

    def stop(self, timeout_s: float = 10.0) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, rank 1 first."""
        raise NotImplementedError

    def wait_joined(self, store: dist.Store, timeout_s: float) -> None:
        """Until every worker has reached the store; a worker that dies first is an error
        at once, not after the timeout."""
        deadline = time.monotonic() + timeout_s
        for rank in range(1, self.layout.world):
            while not store.check([JOINED_KEY.format(rank=rank)]):
                self.check()
                if time.monotonic() > deadline:
                    raise ParallelGroupError(f"{self.layout.describe(rank)} did not start "
                                             f"within {timeout_s:.0f} s")
                time.sleep(0.05)


class LocalWorkers(WorkerRanks):
    """Worker ranks 1 .. world-1 as child processes of rank 0."""

    def __init__(self, procs: list[subprocess.Popen], layout: RankLayout | None = None) -> None:
        self.procs = procs
        self.layout = layout or RankLayout(tp=len(procs) + 1)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @classmethod
    def spawn(cls, layout: RankLayout, port: int, timeout_s: float) -> LocalWorkers:
        world_size = layout.world
        procs = []
        for rank in range(1, world_size):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size),
                   "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   LEADER_PID_ENV: str(os.getpid()),
                   "TESSELLM_DISTRIBUTED_TIMEOUT_S": str(timeout_s)}
            procs.append(subprocess.Popen([sys.executable, "-m", "tessellm.parallel.worker"],
                                          env=env))
            log.info("%s: pid %d", layout.describe(rank), procs[-1].pid)
        return cls(procs, layout)

    def check(self, grace_s: float = 0.0) -> None:
        """Raise ParallelGroupError naming the first worker found exited (polling for up to
        `grace_s` seconds)."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None:
                    raise ParallelGroupError(f"{self.layout.describe(rank)} (pid {p.pid}) "
                                             f"exited with code {code}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        for p in self.procs:
            p.kill()


def parallel_layout(config: EngineConfig) -> RankLayout:
    return RankLayout(config.tensor_parallel_size, config.pipeline_parallel_size)


def start_group(config: EngineConfig) -> ParallelGroup:
    """Rank 0's side: the group joined, the workers started (unless a launcher did) and told
    the config."""
    layout = parallel_layout(config)
    world, timeout_s = layout.world, config.distributed_timeout_s
    if dist.is_initialized():
        raise ConfigError("a tensor-parallel engine is already running in this process; "
                          "close it first (LLM.close())")
    launched = launcher_environment()
    if launched is not None:
        rank, launched_world = launched
        if launched_world != world:
            raise ConfigError(f"tensor_parallel_size={layout.tp} x pipeline_parallel_size="
                              f"{layout.pp} needs {world} ranks but the launcher started "
                              f"{launched_world} (WORLD_SIZE)")
        if rank != 0:
            raise ConfigError(f"launcher rank {rank} is a worker: run "
                              "`python -m tessellm.parallel.worker` there (the tessellm CLI "
                              "does so by itself)")
        if config.distributed_executor_backend == "ray":
            raise ConfigError("distributed_executor_backend='ray' starts the ranks as Ray "
                              "actors: run it without a launcher (torchrun), or use 'mp'")
        group = join(0, world, timeout_s)
    else:
        # the store listens on every interface; the workers reach it at `host`
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        workers: WorkerRanks
        if config.distributed_executor_backend == "ray":
            from tessellm.parallel.ray_workers import RayWorkers
            actors = RayWorkers.start(layout, config, store.port)
            # every actor runs the threads its bundle reserved
            config = config.model_copy(update={"num_threads": actors.threads})
            workers = actors
        else:
            workers = LocalWorkers.spawn(layout, store.port, timeout_s)
        try:
            workers.wait_joined(store, timeout_s)
            group = join(0, world, timeout_s, store=store)
        except BaseException:
            workers.kill()
            raise
        group.workers = workers
    group.channel.send(WorkerInit(config.model_dump_json()))
    return group
