"""AsyncEngine: the asyncio front end over an engine core (here on a thread of the test
process, over inproc sockets: the same loop and messages as the server's core process;
stories260K, float32, CPU)."""
from __future__ import annotations

import asyncio

import pytest

from tessellm import LLM, SamplingParams
from tessellm.engine.async_engine import AsyncEngine, QueueFullError
from tessellm.engine.core_client import EngineCoreClient, EngineCoreError
from tessellm.errors import InvalidRequestError

PROMPTS = ["Once upon a time", "The dog", "Lily and Ben", "One day, a little bird",
           "Tom had a red ball.", "The sun was", "A big fish", "Mom said"]


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False,
               max_num_seqs=4, max_num_batched_tokens=32)


async def start_engine(llm, **options) -> AsyncEngine:
    core = EngineCoreClient.in_thread(llm.engine)
    await core.wait_ready()
    engine = AsyncEngine(core, llm.tokenizer, **options)
    engine.start()
    return engine


async def _collect(stream):
    text, ids, last = "", [], None
    async for delta in stream:
        text += delta.text
        ids += delta.token_ids
        last = delta
    return text, ids, last


def test_concurrent_streams_equal_offline_generate(llm):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    offline = llm.generate(PROMPTS, params)

    async def main():
        engine = await start_engine(llm)
        streams = [engine.add_request(llm.encode(p), params, f"r{i}")
                   for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        await engine.shutdown()
        return results

    results = asyncio.run(main())
    for (text, ids, last), off in zip(results, offline):
        assert ids == off.token_ids and text == off.text
        assert last.finished and last.finish_reason == "length"


def test_closing_a_stream_aborts_and_frees_blocks(llm):
    async def main():
        engine = await start_engine(llm)
        stream = engine.add_request(llm.encode("Once upon a time"),
                                    SamplingParams(max_tokens=400, temperature=0.0), "long")
        got = 0
        async for delta in stream:
            got += len(delta.token_ids)
            if got >= 3:
                break
        await stream.aclose()
        for _ in range(100):
            if not llm.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        await engine.shutdown()

    asyncio.run(main())
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_stop_string_trims_text_and_finishes(llm):
    params = SamplingParams(max_tokens=40, temperature=0.0)
    full = llm.generate(["Once upon a time"], params)[0].text
    assert "Lily" in full

    async def main():
        engine = await start_engine(llm)
        result = await _collect(engine.add_request(llm.encode("Once upon a time"), params, "s",
                                                   stop=["Lily"]))
        await engine.shutdown()
        return result

    text, _, last = asyncio.run(main())
    assert text == full[:full.index("Lily")]
    assert last.finish_reason == "stop"


def test_queue_full_and_invalid_requests_are_refused(llm):
    """max_waiting counts requests beyond the running batch's free seats (max_num_seqs = 4
    here): a burst of 4 + 2 is taken before the core has reported anything, the next one is
    QueueFullError, and a group that could never wait at once (n > max_waiting) is a 400."""
    async def main():
        engine = await start_engine(llm, max_waiting=2)
        params = SamplingParams(max_tokens=4, temperature=0.0)
        first = [engine.add_request([1, 2, 3], params, f"q{i}") for i in range(4 + 2)]
        with pytest.raises(QueueFullError):
            engine.add_request([1, 2, 3], params, "q-over")
        with pytest.raises(InvalidRequestError, match="at most 2 may wait"):
            engine.add_request_group([1, 2, 3], params, 3, "too-many")
        with pytest.raises(InvalidRequestError):
            engine.add_request([], params, "empty")
        with pytest.raises(InvalidRequestError, match="already in flight"):
            engine.add_request([1], params, "q0")
        # the accepted ones still complete
        results = await asyncio.gather(*(_collect(s) for s in first))
        await engine.shutdown()
        return results

    results = asyncio.run(main())
    assert len(results) == 6
    for _, ids, last in results:
        assert len(ids) == 4 and last.finished


def test_the_core_steps_while_the_event_loop_is_busy(llm):
    """The step loop does not run on the event loop: while the loop is blocked (a slow
    handler, detokenization), the core finishes the request; the stream then gets every
    delta in order."""
    import time
    params = SamplingParams(max_tokens=12, temperature=0.0)
    offline = llm.generate(["Once upon a time"], params)[0]

    async def main():
        engine = await start_engine(llm)
        steps0 = llm.engine.stats.num_steps
        stream = engine.add_request(llm.encode("Once upon a time"), params, "p")
        deadline = time.monotonic() + 10
        # 12 tokens: one prefill step and 11 decode steps, all while the loop is blocked
        while llm.engine.has_unfinished() or llm.engine.stats.num_steps < steps0 + 12:
            assert time.monotonic() < deadline
            time.sleep(0.01)  # blocks the event loop on purpose
        result = await _collect(stream)
        await engine.shutdown()
        return result

    text, ids, last = asyncio.run(main())
    assert ids == offline.token_ids and text == offline.text and last.finished


def test_request_group_streams_each_sample_and_shares_the_prompt(llm):
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=11)
    alone = [llm.generate(["Once upon a time"],
                          SamplingParams(max_tokens=10, temperature=0.9, seed=11 + i))[0]
             for i in range(2)]
    prompt_tokens_before = llm.engine.stats.num_prompt_tokens

    async def main():
        engine = await start_engine(llm)
        streams = engine.add_request_group(llm.encode("Once upon a time"), params, 2, "g")
        results = await asyncio.gather(*(_collect(s) for s in streams))
        await engine.shutdown()
        return [s.request_id for s in streams], results

    ids, results = asyncio.run(main())
    assert ids == ["g-0", "g-1"]
    assert [r[1] for r in results] == [a.token_ids for a in alone]
    assert [r[0] for r in results] == [a.text for a in alone]
    # the prompt was computed once for both samples
    assert llm.engine.stats.num_prompt_tokens - prompt_tokens_before == len(
        llm.encode("Once upon a time"))


def test_streams_over_an_async_scheduling_core_equal_offline(llm, stories_dir):
    """The engine core with async scheduling (each step's tokens sent after the next step
    was launched): every stream still equals offline generate, and a closed stream's
    request is aborted with its token in flight dropped, leaving no block held."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    offline = llm.generate(PROMPTS, params)
    overlapping = LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False,
                      max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=True)

    async def main():
        engine = await start_engine(overlapping)
        streams = [engine.add_request(overlapping.encode(p), params, f"r{i}")
                   for i, p in enumerate(PROMPTS)]
        closed = engine.add_request(overlapping.encode(PROMPTS[0]), params, "closed")
        async for _ in closed:
            break
        await closed.aclose()
        results = await asyncio.gather(*(_collect(s) for s in streams))
        await engine.shutdown()
        return results

    results = asyncio.run(main())
    assert [ids for _, ids, _ in results] == [o.token_ids for o in offline]
    assert overlapping.engine.stats.num_overlapped_steps > 0
    assert overlapping.engine.kv.num_free_blocks == overlapping.engine.kv.num_blocks


def test_a_dying_core_says_so_before_it_fails_the_streams(stories_dir, monkeypatch):
    """When the core loop dies (a lost tensor-parallel rank: check_alive raises), it sends
    CoreFailed before the failed outputs, so the front end marks the engine dead and fails
    every stream in one go: a client that saw its stream fail never gets /health 200 (sent
    the other way round, a server client's /health raced the second message)."""
    from tessellm.engine.core_messages import CoreFailed, StepOutputs
    from tessellm.engine.engine_core import EngineCoreLoop
    from tessellm.parallel.group import ParallelGroupError
    llm = LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False,
              max_num_seqs=2, enforce_eager=True)
    calls, sent = {"n": 0}, []

    def check_alive() -> None:
        calls["n"] += 1
        if calls["n"] > 8:   # a few steps into the stream
            raise ParallelGroupError("tensor-parallel rank 1 (pid 1) exited")
    monkeypatch.setattr(llm.engine, "check_alive", check_alive)
    send = EngineCoreLoop.send

    def recording_send(self, message) -> None:
        sent.append(message)
        send(self, message)
    monkeypatch.setattr(EngineCoreLoop, "send", recording_send)

    async def main():
        engine = await start_engine(llm)
        alive_at_error = []
        stream = engine.add_request(llm.encode("Once upon a time"),
                                    SamplingParams(max_tokens=200, ignore_eos=True), "r0")
        async for delta in stream:
            if delta.error:
                alive_at_error.append(engine.is_alive)
        await engine.wait_dead()
        await engine.shutdown()
        return alive_at_error, engine.fatal_error

    alive_at_error, fatal = asyncio.run(main())
    assert alive_at_error == [False] and "rank 1" in fatal
    last = [m for m in sent if isinstance(m, (CoreFailed, StepOutputs))][-2:]
    assert isinstance(last[0], CoreFailed) and isinstance(last[1], StepOutputs)
    llm.engine.abort("r0")   # the dead core left it to whoever owns the engine


def test_a_core_thread_that_fails_to_start_says_why(monkeypatch):
    import tessellm.engine.kernel_warmup as kernel_warmup

    def fail(engine, progress=None):
        raise RuntimeError("no kernel for op 'x'")

    monkeypatch.setattr(kernel_warmup, "prepare_kernels", fail)

    async def main():
        core = EngineCoreClient.in_thread(object())   # fails before it reads the engine
        try:
            with pytest.raises(EngineCoreError, match="failed to start: RuntimeError: no kernel"):
                await core.wait_ready()
        finally:
            core.close()

    asyncio.run(main())
