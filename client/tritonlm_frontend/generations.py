"""Running an API request's generations through Triton: several prompts at once (their responses
merged as they come), whole or streamed, and each sequence's text, tokens and logprobs summed up."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .triton_gateway import GenerateChunk, GenerateRequest, SequenceDelta, TritonGateway

_END = object()
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports impossible tokens this way too


def clamped_logprob(value: float | None) -> float | None:
    """A logprob JSON can carry (None stays None)."""
    return None if value is None else max(value, MIN_LOGPROB)


async def merged(gateway: TritonGateway, requests: list[GenerateRequest]
                 ) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """(request index, chunk) pairs of every request, in arrival order; the first error raises,
    and closing the iterator cancels every request still running."""
    if len(requests) == 1:
        async for chunk in gateway.generate(requests[0]):
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, request: GenerateRequest) -> None:
        try:
            async for chunk in gateway.generate(request):
                queue.put_nowait((index, chunk))
        except Exception as exc:  # handed to the reader, who raises it
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, _END))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # cancels their Triton requests when they still run


async def first_and_rest(chunks: AsyncIterator) -> AsyncIterator:
    """`chunks` with its first item already awaited, so that a request Triton rejects fails
    before a streamed response's status line is sent."""
    first = await chunks.__anext__()

    async def rest():
        try:
            yield first
            async for item in chunks:
                yield item
        finally:
            await chunks.aclose()
    return rest()


@dataclass
class SequenceResult:
    """One sequence's whole output, gathered from its deltas."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None

    def add(self, delta: SequenceDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.finish_reason else self.stop_reason
        if delta.cumulative_logprob is not None:
            self.cumulative_logprob = delta.cumulative_logprob


@dataclass
class GenerationResult:
    """One Triton request's whole result."""
    sequences: list[SequenceResult] = field(default_factory=list)
    num_input_tokens: int = 0
    prompt_logprobs: list[dict | None] | None = None

    def add(self, chunk: GenerateChunk) -> None:
        for delta in chunk.sequences:
            while len(self.sequences) <= delta.index:
                self.sequences.append(SequenceResult())
            self.sequences[delta.index].add(delta)
        if chunk.num_input_tokens is not None:
            self.num_input_tokens = chunk.num_input_tokens
        if chunk.prompt_logprobs:
            self.prompt_logprobs = chunk.prompt_logprobs

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


async def collect(gateway: TritonGateway, requests: list[GenerateRequest]) -> list[GenerationResult]:
    """Every request's whole result, in request order."""
    results = [GenerationResult() for _ in requests]
    async for index, chunk in merged(gateway, requests):
        results[index].add(chunk)
    return results
