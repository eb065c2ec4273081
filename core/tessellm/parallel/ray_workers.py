"""Worker ranks as Ray actors (`distributed_executor_backend: ray`).

Rank 0 (the engine's process) joins the Ray cluster at `ray_address` (or starts a local one
of exactly the CPUs its workers ask for: tessellm.ray.cluster), reserves a placement group of
one bundle per worker rank (`num_cpus` = threads per rank, and a GPU each on cuda; strategy
`ray_placement_strategy`: PACK, as few nodes as fit, or SPREAD), and starts one `WorkerRankActor` per bundle. Each actor runs the
worker's main loop (parallel.worker.run_rank) in its own process, joining rank 0's TCP store
at an address reachable from its node: loopback on a local cluster, rank 0's node address in
the cluster otherwise. From there on the group is the mp backend's (the same store, the same
control channel and collectives).

The actor's `run` call lasts the worker's life, so its death is that call's failure: `check`
sees it (RayActorError) and names the rank and stage. `stop` waits for the `run` calls to
return after Stop, then kills the actors, removes the placement group and, when this process
started Ray, shuts it down. Ray kills the actors by itself if rank 0's process dies (they are
owned by it, not detached).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from tessellm.config import EngineConfig
from tessellm.errors import ConfigError
from tessellm.parallel.group import ParallelGroupError
from tessellm.parallel.launch import WorkerRanks
from tessellm.parallel.layout import RankLayout
from tessellm.ray.cluster import import_ray, join_cluster, reachable_host

log = logging.getLogger(__name__)
POLL_S = 0.25


class WorkerRankActor:
    """One worker rank; decorated with ray.remote in `RayWorkers.start` (Ray is imported only
    there). `pid` first, then `run`, which returns when rank 0 says Stop."""

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        import ray
        return ray.util.get_node_ip_address()

    def run(self, rank: int, world: int, timeout_s: float, host: str, port: int,
            cuda: bool) -> int:
        from tessellm.parallel.worker import run_rank
        if cuda:   # Ray gave this actor one GPU as CUDA_VISIBLE_DEVICES: it is device 0
            os.environ["LOCAL_RANK"] = "0"
        return run_rank(rank, world, timeout_s, (host, port))


class RayWorkers(WorkerRanks):
    def __init__(self, ray: Any, layout: RankLayout, actors: list[Any], runs: list[Any],
                 pids: list[int], nodes: list[str], placement: Any, owns_ray: bool,
                 threads: int) -> None:
        self.ray, self.layout = ray, layout
        self.actors, self.runs, self._pids, self.nodes = actors, runs, pids, nodes
        self.placement, self.owns_ray, self.threads = placement, owns_ray, threads
        self._ended = False
        self._polled = 0.0

    @classmethod
    def start(cls, layout: RankLayout, config: EngineConfig, port: int) -> RayWorkers:
        """Join or start the cluster, reserve the bundles and start the actors (running)."""
        ray = import_ray("distributed_executor_backend='ray' starts its ranks on Ray")
        workers = layout.world - 1
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // layout.world)
        cuda = config.device == "cuda"
        owns = join_cluster(config.ray_address, threads * workers,
                            "distributed_executor_backend='ray' starts its ranks on Ray")
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        bundle = {"CPU": threads, **({"GPU": 1} if cuda else {})}
        placement = placement_group([bundle] * workers, strategy=config.ray_placement_strategy)
        ready, _ = ray.wait([placement.ready()], timeout=config.distributed_timeout_s)
        if not ready:
            message = (f"the Ray cluster cannot place {workers} worker ranks of {bundle} "
                       f"each within {config.distributed_timeout_s:.0f} s (cluster "
                       f"resources: {ray.cluster_resources()})")
            remove_placement_group(placement)
            if owns:
                ray.shutdown()
            raise ConfigError(message)
        remote = ray.remote(WorkerRankActor)
        actors = [remote.options(num_cpus=threads, num_gpus=1 if cuda else 0, max_restarts=0,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(
                                     placement, placement_group_bundle_index=i)).remote()
                  for i in range(workers)]
        started = cls(ray, layout, actors, [], [], [], placement, owns, threads)
        try:   # the actors' processes are up (or their start failed) within the timeout
            started._pids = ray.get([a.pid.remote() for a in actors],
                                    timeout=config.distributed_timeout_s)
            started.nodes = ray.get([a.node.remote() for a in actors])
        except BaseException as e:
            started.kill()
            if isinstance(e, Exception):
                raise ParallelGroupError(f"the worker ranks' Ray actors did not start: "
                                         f"{type(e).__name__}: {e}") from e
            raise
        host = reachable_host(config.ray_address is None)
        started.runs = [a.run.remote(rank, layout.world, config.distributed_timeout_s, host,
                                     port, cuda) for rank, a in enumerate(actors, start=1)]
        for rank in range(1, layout.world):
            log.info("%s: Ray actor pid %d on %s", layout.describe(rank),
                     started._pids[rank - 1], started.nodes[rank - 1])
        return started

    @property
    def pids(self) -> list[int]:
        return list(self._pids)

    def check(self, grace_s: float = 0.0) -> None:
        """As LocalWorkers.check; without a grace, Ray is asked at most every POLL_S (the
        engine checks before every step; a step a death fails asks again with a grace)."""
        now = time.monotonic()
        if not grace_s and now - self._polled < POLL_S:
            return
        self._polled = now
        deadline = now + grace_s
        while True:
            done, _ = self.ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
            for rank, run in enumerate(self.runs, start=1):
                if run in done:
                    raise ParallelGroupError(f"{self.layout.describe(rank)} (Ray actor pid "
                                             f"{self._pids[rank - 1]} on "
                                             f"{self.nodes[rank - 1]}) {self._ended_how(run)}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _ended_how(self, run: Any) -> str:
        try:
            return f"exited with code {self.ray.get(run)}"
        except Exception as e:   # RayActorError: the process died
            return f"died: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.runs:   # after Stop every run call returns
            self.ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        """Kill the actors, remove the placement group, shut Ray down when this started it."""
        if self._ended:
            return
        self._ended = True
        from ray.util.placement_group import remove_placement_group
        for actor in self.actors:
            self.ray.kill(actor)
        remove_placement_group(self.placement)
        if self.owns_ray:
            self.ray.shutdown()
