"""AsyncEngine: engine thread + asyncio streams (stories260K, float32, CPU)."""
from __future__ import annotations

import asyncio

import pytest

from tessellm import LLM, SamplingParams
from tessellm.engine.async_engine import AsyncEngine, QueueFullError
from tessellm.errors import InvalidRequestError

PROMPTS = ["Once upon a time", "The dog", "Lily and Ben", "One day, a little bird",
           "Tom had a red ball.", "The sun was", "A big fish", "Mom said"]


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False,
               max_num_seqs=4, max_num_batched_tokens=32)


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
        engine = AsyncEngine(llm.engine)
        engine.start()
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
        engine = AsyncEngine(llm.engine)
        engine.start()
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
        engine = AsyncEngine(llm.engine)
        engine.start()
        result = await _collect(engine.add_request(llm.encode("Once upon a time"), params, "s",
                                                   stop=["Lily"]))
        await engine.shutdown()
        return result

    text, _, last = asyncio.run(main())
    assert text == full[:full.index("Lily")]
    assert last.finish_reason == "stop"


def test_queue_full_and_invalid_requests_are_refused(llm):
    async def main():
        engine = AsyncEngine(llm.engine, max_waiting=2)
        params = SamplingParams(max_tokens=4, temperature=0.0)
        first = [engine.add_request([1, 2, 3], params, f"q{i}") for i in range(2)]
        with pytest.raises(QueueFullError):
            engine.add_request([1, 2, 3], params, "q-over")
        with pytest.raises(InvalidRequestError):
            engine.add_request([], params, "empty")
        with pytest.raises(InvalidRequestError, match="already in flight"):
            engine.add_request([1], params, "q0")
        engine.start()  # the queued ones still complete
        results = await asyncio.gather(*(_collect(s) for s in first))
        await engine.shutdown()
        return results

    for _, ids, last in asyncio.run(main()):
        assert len(ids) == 4 and last.finished


def test_output_processing_is_pipelined_with_engine_steps(llm, monkeypatch):
    """Detokenization runs on its own thread: while it is blocked, the engine thread keeps
    stepping (here: finishes the whole request); the stream then gets every delta in order."""
    import threading

    from tessellm.engine.output_processor import OutputProcessor

    release = threading.Event()
    threads = set()
    real_process = OutputProcessor.process

    def blocked_process(self, raw):
        threads.add(threading.current_thread().name)
        release.wait(10)
        return real_process(self, raw)

    monkeypatch.setattr(OutputProcessor, "process", blocked_process)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    offline = llm.generate(["Once upon a time"], params)[0]

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        stream = engine.add_request(llm.encode("Once upon a time"), params, "p")
        for _ in range(500):
            if not llm.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        finished_while_blocked = not llm.engine.has_unfinished()
        release.set()
        result = await _collect(stream)
        await engine.shutdown()
        return finished_while_blocked, result

    finished_while_blocked, (text, ids, last) = asyncio.run(main())
    assert finished_while_blocked
    assert threads == {"tessellm-outputs"}
    assert ids == offline.token_ids and text == offline.text and last.finished


def test_request_group_streams_each_sample_and_shares_the_prompt(llm):
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=11)
    alone = [llm.generate(["Once upon a time"],
                          SamplingParams(max_tokens=10, temperature=0.9, seed=11 + i))[0]
             for i in range(2)]
    prompt_tokens_before = llm.engine.stats.num_prompt_tokens

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
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
