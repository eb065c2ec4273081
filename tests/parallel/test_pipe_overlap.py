"""Micro-batches in flight through two stages (tessellm.parallel.pipe.StageLink over gloo, two
forked processes, fake plans): stage 0 runs micro-batch 1 while stage 1 runs micro-batch 0,
and rank 0 gets every micro-batch's logits back in the step's order.

The overlap is shown by a rendezvous, not by timing: stage 0's plan for micro-batch 1 and
stage 1's plan for micro-batch 0 each wait (through the store) for the other to have started.
A pipe that made stage 0 wait for anything of micro-batch 0 downstream (its logits, a blocking
hand-over) before starting micro-batch 1 never meets and fails after the wait's timeout."""
from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from tessellm.engine.step_inputs import ForwardRows
from tessellm.models.pipeline import HIDDEN_FEED
from tessellm.parallel.layout import RankLayout
from tessellm.parallel.micro_batches import split_rows
from tessellm.parallel.pipe import StageLink

HIDDEN, VOCAB = 4, 3
# two prefills of 3 tokens, each sampled, each with a prompt-logprobs row: the step's logits
# rows are (2, 5, 0, 3), the micro-batches' (2, 0) and (5, 3)
ROWS = ForwardRows(list(range(6)), list(range(6)), list(range(6)), [3, 3], [3, 3],
                   [2, 5, 0, 3], 0, 2, 1)


def _stage(rank: int, port: int, results) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                              timeout=timedelta(seconds=20))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        link = StageLink(dist.new_group(), RankLayout(pp=2), rank, HIDDEN, VOCAB,
                         torch.float32, torch.device("cpu"), micro_batches=2, timeout_s=20)
        split = split_rows(ROWS, link.micro_batches)

        def plan(feeds):
            i = feeds["micro_batch"]
            if (rank, i) in ((0, 1), (1, 0)):   # meet the other stage inside its plan
                store.set(f"in/{rank}/{i}", "1")
                store.wait([f"in/{1 - rank}/{1 - i}"], timedelta(seconds=10))
            if rank == 0:
                return torch.full((len(split.batches[i].tokens), HIDDEN), float(i))
            hidden = feeds[HIDDEN_FEED]
            assert hidden.eq(i).all(), f"micro-batch {i} got stage 0's {hidden[0, 0]}"
            local = split.logits_indices[split.batches[i].logits.start:
                                         split.batches[i].logits.stop]
            # each logits row says which token of the step it is for
            return torch.tensor([[t + split.batches[i].tokens.start] * VOCAB for t in local],
                                dtype=torch.float32)

        out = link.run(plan, [{"micro_batch": i} for i in range(len(split.batches))], split)
        results.put((rank, out[:, 0].tolist() if rank == 0 else None, link.stats.micro_batches))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc(), -1))


def test_stage_zero_runs_micro_batch_one_while_stage_one_runs_micro_batch_zero():
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with socket.socket() as s:   # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_stage, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((rank, (value, count)) for rank, value, count in
               (results.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(10)
    assert got[0][1] == 2 and got[1][1] == 2, got
    assert got[0][0] == [2.0, 5.0, 0.0, 3.0]   # the step's order: sampled, then prompt rows
