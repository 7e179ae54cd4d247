"""Several choices of one prompt (OpenAI's n and best_of, gRPC's n): each a request of its own that shares the
prompt's computed pages and has its own seed stream.

A prompt's copies start once the first copy's prompt is computed (its first token, or its
end, came), so they read its pages from the prefix cache instead of computing the prompt
again. Copy j's seed is the request's plus j times a fixed stride (copy 0 keeps the
request's), so a seeded request gives the same choices every time and n = 1 is the first
copy; without a seed the scheduler draws one for each. `run_all` runs a request's
requests together, so that the first to fail ends the others (SGLang's several prompts too).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Coroutine, Sequence
from typing import Any

import msgspec

from gateway.errors import RequestFailed
from gateway.generation import Generation
from gateway.output import Chunk
from gateway.request import Submission

SEED_STRIDE = 0x9E3779B97F4A7C15  # between the seeds of a prompt's copies


def sibling(submission: Submission, copy: int, request_id: str, *, scores_prompt: bool) -> Submission:
    """Copy `copy` of a prompt's request under `request_id`: its own seed stream when the client gave a seed, and its
    prompt scored only when `scores_prompt` (the other copies echo the first one's)."""
    sampling = submission.sampling
    if copy and submission.seed_given:
        sampling = msgspec.structs.replace(sampling, seed=(sampling.seed + copy * SEED_STRIDE) % 2**63)
    return dataclasses.replace(
        submission,
        request_id=request_id,
        sampling=sampling,
        prompt_logprobs=submission.prompt_logprobs if scores_prompt else None,
    )


class Copy:
    """One copy's request, and the moment its prompt is computed (which the copies after the first wait for)."""

    def __init__(self, submission: Submission, lead: Copy | None) -> None:
        self.submission = submission
        self.lead = lead
        self.prompt_computed = asyncio.Event()

    async def chunks(self, generation: Generation, api: str) -> AsyncGenerator[Chunk, None]:
        """The copy's chunks, once its lead's prompt is computed."""
        if self.lead is not None:
            await self.lead.prompt_computed.wait()
        try:
            async with contextlib.aclosing(generation.chunks(self.submission, api)) as chunks:
                async for chunk in chunks:
                    if chunk.token_ids or chunk.finish_reason is not None:
                        self.prompt_computed.set()
                    yield chunk
        finally:
            self.prompt_computed.set()


async def interleaved(
    copies: Sequence[Copy], generation: Generation, api: str
) -> AsyncGenerator[tuple[int, Chunk], None]:
    """Every copy's chunks as they come, each with its copy's index, until every copy has ended. The first failure is
    raised; leaving early (a failure, a client gone) cancels the copies still running, which aborts their requests."""
    events: asyncio.Queue[tuple[int, Chunk | RequestFailed | None]] = asyncio.Queue()

    async def pump(index: int, copy: Copy) -> None:
        try:
            async with contextlib.aclosing(copy.chunks(generation, api)) as chunks:
                async for chunk in chunks:
                    await events.put((index, chunk))
        except RequestFailed as failure:
            await events.put((index, failure))
            return
        await events.put((index, None))

    tasks = [asyncio.create_task(pump(index, copy)) for index, copy in enumerate(copies)]
    try:
        running = len(copies)
        while running:
            index, event = await events.get()
            if event is None:
                running -= 1
            elif isinstance(event, RequestFailed):
                raise event
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_all(coroutines: list[Coroutine[Any, Any, None]]) -> None:
    """Run them together; the first to fail cancels the others (aborting their requests) and its error is raised."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        await asyncio.gather(*tasks)
    finally:
        await cancel_all(tasks)
        # A failed task holds its error, whose traceback holds this frame, which held the tasks: a cycle that would
        # keep the request (its prompt too) until the collector's rare full pass.
        tasks.clear()


async def cancel_all(tasks: Sequence[asyncio.Future[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
