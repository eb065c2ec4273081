"""A worker rank (> 0) of a tensor-parallel engine: `python -m tessellm.parallel.worker`.

It joins the group (rank 0's store when rank 0 started it, else the launcher's env://),
takes the engine config from rank 0, builds its shard of the model and its KV pool, chooses
its kernels, and then replays rank 0's device work in order until `Stop`: block operations
and forward passes (the collectives inside them keep the ranks in step). It never schedules
or samples. It exits when rank 0 is gone: the control channel's connection closes, and a
worker rank 0 started as a child process also watches that its parent is alive. A Ray actor
(parallel.ray_workers) lives the same life through `run_rank`.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from tessellm.config import EngineConfig
from tessellm.parallel.group import ParallelGroup, join
from tessellm.parallel.launch import JOINED_KEY, LEADER_PID_ENV
from tessellm.lora.manager import LoRAManager
from tessellm.lora.request import LoRARequest
from tessellm.parallel.messages import Batch, BlockOps, LoRALoad, Stop, WorkerInit

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 120.0


def _exit_with_leader(leader_pid: int) -> None:
    """A daemon thread: exit this process once its parent (the leader) is gone."""
    def watch() -> None:
        while os.getppid() == leader_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="tessellm-leader-watch", daemon=True).start()


def serve_steps(config: EngineConfig, group: ParallelGroup) -> None:
    """Build this rank's engine parts, then run rank 0's device work until Stop."""
    from tessellm.engine.builder import build_engine_parts
    from tessellm.engine.kernel_warmup import choose_kernels
    from tessellm.engine.runner_factory import make_model_runner

    parts = build_engine_parts(config, parallel=group)
    runner = make_model_runner(parts)
    lora = LoRAManager.of(parts)
    if config.kernel_selection != "first":
        choose_kernels(parts, sample_kernels=False)
    group.wait_ready()
    swapped_in = None
    while True:
        message = group.channel.recv()
        if isinstance(message, Stop):
            return
        if isinstance(message, BlockOps):
            swapped_in = runner.run_block_ops(message)
        elif isinstance(message, LoRALoad) and lora is not None:
            lora.load_into(message.slot, LoRARequest(message.name, message.int_id, message.path))
        elif isinstance(message, Batch):
            _, uploaded = runner.run_rows(message.forward_rows(), swapped_in,
                                          tables=[message.tables, *message.group_tables])
            swapped_in = None
            runner.wait(uploaded)   # its staging buffers are rewritten by the next batch
        else:
            raise RuntimeError(f"unexpected control message {type(message).__name__}")


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout_s = float(os.environ.get("TESSELLM_DISTRIBUTED_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    store_at = None
    if LEADER_PID_ENV in os.environ:   # started by rank 0 (LocalWorkers)
        _exit_with_leader(int(os.environ[LEADER_PID_ENV]))
        store_at = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return run_rank(rank, world, timeout_s, store_at)


def run_rank(rank: int, world: int, timeout_s: float,
             store_at: tuple[str, int] | None = None) -> int:
    """One worker rank's life: join (rank 0's TCP store at `store_at`, noted as joined; else
    the launcher's env://), take the config, replay rank 0's work until Stop. A failure
    ends the process at once (os._exit: the other ranks see its connections close)."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s[rank "
                        f"{rank}]: %(message)s")
    store = None
    if store_at is not None:
        store = dist.TCPStore(store_at[0], store_at[1], world, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        store.set(JOINED_KEY.format(rank=rank), "1")
    group = join(rank, world, timeout_s, store=store)
    try:
        init = group.channel.recv()
        if not isinstance(init, WorkerInit):
            raise RuntimeError(f"expected the engine config first, got {type(init).__name__}")
        serve_steps(EngineConfig.model_validate_json(init.config_json), group)
    except KeyboardInterrupt:
        return 1
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)   # leave at once: the other ranks see this rank's connections close
    group.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
