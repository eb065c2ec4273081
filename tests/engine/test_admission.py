"""Admission is one transaction: a failure at any of its steps (injected through the
AsyncEngine's admission_fault seam) leaves no trace — no stream, no output state, nothing
counted as queued, nothing in the core — and the engine serves the next request as before.
Engine core on a thread of the test process (stories260K, float32, CPU)."""
from __future__ import annotations

import asyncio

import pytest

from tessellm import LLM, SamplingParams
from tessellm.engine.async_engine import ADMISSION_STEPS, AsyncEngine
from tessellm.engine.core_client import EngineCoreClient
from tessellm.errors import InvalidRequestError
from tessellm.sampling_params import MAX_STOP_STRINGS


class InjectedAdmissionFault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False,
               max_num_seqs=4, max_num_batched_tokens=64)


def fail_at(step: str):
    def fault(name: str) -> None:
        if name == step:
            raise InjectedAdmissionFault(f"injected at {step}")
    return fault


async def start_engine(llm: LLM, **options) -> AsyncEngine:
    core = EngineCoreClient.in_thread(llm.engine)
    await core.wait_ready()
    engine = AsyncEngine(core, llm.tokenizer, **options)
    engine.start()
    return engine


async def settled_stats(engine: AsyncEngine):
    """The core's report after it has taken every message sent so far: the second report
    to arrive from now was sent after a drain of the core's inbox that followed our sends."""
    for _ in range(2):
        seen = engine.stats
        while engine.stats is seen:
            await asyncio.sleep(0.01)
    return engine.stats


async def collect(stream) -> list[int]:
    ids = []
    async for delta in stream:
        ids += delta.token_ids
    return ids


def assert_no_trace(engine: AsyncEngine, stats) -> None:
    assert engine._streams == {} and engine.num_queued == 0 and engine.num_waiting == 0
    assert engine._outputs.tracked == {} and engine._unscheduled == set()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0.0


@pytest.mark.parametrize("step", ADMISSION_STEPS)
@pytest.mark.parametrize("n", [1, 3])
def test_a_failure_at_any_admission_step_leaves_no_trace(llm, step, n):
    params = SamplingParams(max_tokens=4, temperature=0.0, seed=1)
    expected = llm.generate([[1, 2, 3]], params)[0].token_ids
    armed = {"on": True}

    def fault(name: str) -> None:
        if armed["on"]:
            fail_at(step)(name)

    async def main():
        engine = await start_engine(llm, max_waiting=8, admission_fault=fault)
        try:
            with pytest.raises(InjectedAdmissionFault):
                engine.add_request_group([1, 2, 3], params, n, "victim", stop=["zzz"])
            assert_no_trace(engine, await settled_stats(engine))
            armed["on"] = False   # the same id is free again, and the engine serves as before
            streams = engine.add_request_group([1, 2, 3], params, n, "victim", stop=["zzz"])
            outputs = await asyncio.gather(*(collect(s) for s in streams))
            assert_no_trace(engine, await settled_stats(engine))
            return outputs
        finally:
            await engine.shutdown()

    outputs = asyncio.run(main())
    assert outputs[0] == expected and len(outputs) == n


@pytest.mark.parametrize("params,message", [
    (dict(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "at most 16 stop strings"),
    (dict(top_k=2 ** 70), "top_k must fit in 64 bits"),
    (dict(stop_token_ids=[2 ** 70]), "stop_token_ids must fit in 64 bits"),
    (dict(seed=-(2 ** 64)), "seed must fit in 64 bits"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(top_p=float("nan")), "top_p must be a finite number"),
])
def test_values_the_core_cannot_carry_are_refused_at_validation(params, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**params)


def test_out_of_vocabulary_stop_token_ids_and_many_stop_strings_through_the_engine(llm):
    async def main():
        engine = await start_engine(llm, max_waiting=8)
        try:
            with pytest.raises(InvalidRequestError, match="stop_token_ids out of range"):
                engine.add_request([1, 2], SamplingParams(stop_token_ids=[10 ** 9]), "oov")
            stops = [f"@{i}@" for i in range(MAX_STOP_STRINGS)]   # the most there may be
            stream = engine.add_request([1, 2], SamplingParams(max_tokens=3), "stops",
                                        stop=stops)
            ids = await collect(stream)
            assert_no_trace(engine, await settled_stats(engine))
            return ids
        finally:
            await engine.shutdown()

    assert len(asyncio.run(main())) == 3


def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=1e-38).greedy
    assert SamplingParams(temperature=9e-6).temperature == 0.0
    assert not SamplingParams(temperature=1e-4).greedy
