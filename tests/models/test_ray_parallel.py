"""`distributed_executor_backend: ray`: the worker ranks as Ray actors in a placement group on
one local Ray cluster of 3 CPUs shared by the module (float32, 1 thread per rank, against one
process): pipeline stages and tensor-parallel ranks give the same greedy tokens; a killed
actor fails every open request with its stage named; closing the engine kills the actors and
gives the placement group's CPUs back; ranks the cluster cannot place are a start-up error."""
from __future__ import annotations

import time

import pytest

from hf_fixtures import STORIES_260K
from parallel_fixtures import assert_killed_worker_fails_requests
from tessellm import LLM, SamplingParams

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tessellm[ray]')")

CPUS = 3
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 403, 407, 261, 378], [1, *range(20, 200, 10)], [1, 5, 6]]
OPTIONS = dict(device="cpu", dtype="float32", num_threads=1, max_num_seqs=4, block_size=16,
               num_kv_blocks=32, load_progress=False, kernel_selection="first",
               pipeline_micro_batch_tokens=1)   # decode steps in micro-batches too


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=CPUS, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def want() -> list:
    with LLM(str(STORIES_260K), **OPTIONS) as one:
        return _tokens(one)


def _tokens(llm: LLM) -> list:
    return [o.outputs[0].token_ids for o in llm.generate([list(p) for p in PROMPTS], GREEDY)]


def _free_cpus(want: float = CPUS, within_s: float = 10.0) -> float:
    """The cluster's free CPUs once they are `want` (Ray frees a removed placement group's
    bundles asynchronously), or after `within_s`."""
    deadline = time.monotonic() + within_s
    while (free := ray.available_resources().get("CPU", 0.0)) != want \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


@pytest.mark.parametrize("tp,pp,strategy", [(1, 2, "PACK"), (2, 1, "SPREAD")])
def test_ranks_as_ray_actors_equal_one_process(cluster, want, tp, pp, strategy):
    from tessellm.parallel.ray_workers import RayWorkers
    with LLM(str(STORIES_260K), tensor_parallel_size=tp, pipeline_parallel_size=pp,
             distributed_executor_backend="ray", ray_placement_strategy=strategy,
             **OPTIONS) as llm:
        workers = llm.engine.parts.parallel.workers
        assert isinstance(workers, RayWorkers) and not workers.owns_ray
        table = ray.util.placement_group_table(workers.placement)
        assert table["strategy"] == strategy and table["state"] == "CREATED"
        assert _free_cpus(CPUS - 1) == CPUS - 1   # one bundle of 1 CPU for rank 1
        assert _tokens(llm) == want
    assert _free_cpus() == CPUS   # actors killed, placement group removed


def test_a_killed_actor_fails_every_request_naming_its_stage(cluster):
    llm = LLM(str(STORIES_260K), pipeline_parallel_size=2, distributed_executor_backend="ray",
              **{**OPTIONS, "num_kv_blocks": 64})
    try:
        assert_killed_worker_fails_requests(llm, r"pipeline stage 1 \(rank 1\) \(Ray actor pid")
    finally:
        llm.close()
    assert _free_cpus() == CPUS


def test_ranks_the_cluster_cannot_place_are_a_start_up_error(cluster):
    """A bundle of 8 CPUs on a 3-CPU cluster: refused after distributed_timeout_s naming
    the bundle, nothing left reserved and no group joined."""
    import torch.distributed as dist
    from tessellm.errors import ConfigError
    with pytest.raises(ConfigError, match=r"cannot place 1 worker ranks of \{'CPU': 8\}"):
        LLM(str(STORIES_260K), pipeline_parallel_size=2, distributed_executor_backend="ray",
            **{**OPTIONS, "num_threads": 8, "distributed_timeout_s": 2.0})
    assert not dist.is_initialized()
    assert _free_cpus() == CPUS
