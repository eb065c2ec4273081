"""Merging the engine streams of one HTTP request (n choices, several prompts).

`merged(streams)` yields (choice index, delta) in arrival order until every stream has sent
its finished delta. Leaving it early (client gone, handler cancelled, an error answered)
closes it, which aborts every stream still running: their KV blocks are freed by the engine
thread before its next step.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from tessellm.engine.async_engine import RequestStream
from tessellm.engine.output_processor import StreamDelta


async def _pump(index: int, stream: RequestStream,
                out: asyncio.Queue[tuple[int, StreamDelta]]) -> None:
    async for delta in stream:
        out.put_nowait((index, delta))


async def _iterate(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, StreamDelta]]:
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, StreamDelta]] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, delta = await queue.get()
            if delta.finished:
                remaining -= 1
            yield index, delta
    finally:
        for t in tasks:
            t.cancel()


@asynccontextmanager
async def merged(streams: Sequence[RequestStream]):
    """`async with merged(streams) as deltas: async for index, delta in deltas: ...`;
    on exit every unfinished stream is aborted."""
    it = _iterate(streams)
    try:
        yield it
    finally:
        await it.aclose()
        for s in streams:
            s.abort()
