"""What every API's routes share: JSON bodies read with a clear error, Server-Sent Events, and
cancellation of a request whose client went away."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from .errors import APIError

logger = logging.getLogger("tritonlm.frontend")
Model = TypeVar("Model", bound=BaseModel)


async def read_body(request: Request, schema: type[Model], status: int = 400) -> Model:
    """The request's JSON body as `schema`; bad JSON or a wrong field is an APIError naming it.
    Fields the schema does not know are kept, logged and otherwise ignored (vLLM's behaviour:
    clients send fields newer than the server)."""
    raw = await request.body()
    try:
        value = json.loads(raw) if raw else None
    except ValueError as exc:  # bad JSON or UTF-8, or an integer of more digits than Python reads
        raise APIError(status, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(status, "the request body is nested too deeply") from None
    try:  # JSON's \ud800-style escapes can spell lone surrogates, which no UTF-8 text holds
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(status, f"the request body holds a lone surrogate, not text: {exc}") \
            from None
    if not isinstance(value, dict):
        raise APIError(status, "the request body must be a JSON object")
    try:
        parsed = schema.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise APIError(status, f"{where}: {first['msg']} (got {first.get('input')!r})",
                       where or None) from None
    unknown = sorted(parsed.model_extra or ())
    if unknown:
        logger.info("%s: ignoring unknown fields %s", request.url.path, unknown)
    return parsed


def sse_event(data: Any) -> str:
    """One Server-Sent Event carrying `data` (a JSON value, or a str sent as it is)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                         separators=(",", ":"))
    return f"data: {text}\n\n"


def request_id(request: Request) -> str | None:
    """The client's X-Request-Id (vLLM honours it too): Triton's request id, in the engine's log."""
    return request.headers.get("x-request-id")


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """A text/event-stream response; when the client disconnects, Starlette cancels the task
    iterating `events`, whose generators then cancel their Triton requests."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


T = TypeVar("T")


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work` (a whole non-streamed generation) but cancel it, and so its Triton requests,
    as soon as the client disconnects."""
    task = asyncio.ensure_future(work())

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise APIError(499, "the client disconnected")
    return task.result()
