"""Several tritonservers serving the same repository behind one front end
(`tritonlm-frontend --triton-url A --triton-url B ...`), with TritonGateway's interface.

Each request goes to the replica with the fewest requests outstanding from here, unless a replica
served a request recently whose input began the same way (same model and adapter, same first
AFFINITY_CHARS characters or AFFINITY_TOKENS token ids): its prefix cache likely still holds those
KV blocks, so it keeps such requests while it has at most AFFINITY_SLACK more outstanding than the
least busy replica (a hot prefix spills over instead of overloading one replica).

`routing="round-robin"` takes the replicas in turn instead (to compare against).

A replica is taken out when it cannot be reached (a request fails to connect, or a health check
fails) and probed again every HEALTH_INTERVAL seconds. A request one replica refused before
generating anything (unreachable, the model not loaded there or stopping, full, its engine failed)
is sent to another, and gets the last refusal when every replica refused it; a stream that has
started ends with the error.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .errors import APIError
from .triton_gateway import GenerateChunk, GenerateRequest, ReplicaUnreachable, TritonGateway

logger = logging.getLogger("tritonlm.frontend")

AFFINITY_CHARS = 256
AFFINITY_TOKENS = 64
AFFINITY_ENTRIES = 4096  # prefixes remembered, least recently used dropped first
AFFINITY_SLACK = 4
HEALTH_INTERVAL = 2.0
HEALTH_TIMEOUT = 2.0
# Refusals before any response that another replica may not give: the model not (or no longer)
# loaded there, as while it stops; full; its engine failed; tritonserver unreachable.
REFUSALS_ANOTHER_MAY_SERVE = (404, 429, 500, 502, 503)


@dataclass(eq=False)
class Replica:
    gateway: TritonGateway
    outstanding: int = 0
    healthy: bool = True


def prefix_key(request: GenerateRequest) -> str:
    """What requests likely to share prefix-cache blocks have in common."""
    if request.messages is not None:
        start = json.dumps(request.messages)[:AFFINITY_CHARS]
    elif isinstance(request.prompt, str):
        start = request.prompt[:AFFINITY_CHARS]
    else:
        start = json.dumps(list(request.prompt or [])[:AFFINITY_TOKENS])
    return json.dumps([request.model, request.sampling.get("lora_name"), start])


ROUTINGS = ("prefix-affinity", "round-robin")


class ReplicaPool:
    def __init__(self, urls: list[str], routing: str = "prefix-affinity"):
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {routing!r}")
        self.routing = routing
        self.replicas = [Replica(TritonGateway(url)) for url in urls]
        self.url = ", ".join(urls)
        self._affinity: OrderedDict[str, Replica] = OrderedDict()
        self._turn = 0  # rotates ties between equally busy replicas
        self._watcher: asyncio.Task | None = None

    def pick(self, key: str, excluded: set[Replica]) -> Replica:
        candidates = [r for r in self.replicas if r.healthy and r not in excluded]
        if not candidates:
            raise APIError(503, f"no tritonserver replica is reachable ({self.url})")
        self._turn += 1
        if self.routing == "round-robin":
            return candidates[self._turn % len(candidates)]
        least = min(r.outstanding for r in candidates)
        preferred = self._affinity.get(key)
        if preferred in candidates and preferred.outstanding <= least + AFFINITY_SLACK:
            chosen = preferred
        else:
            idle = [r for r in candidates if r.outstanding == least]
            chosen = idle[self._turn % len(idle)]
        self._affinity[key] = chosen
        self._affinity.move_to_end(key)
        if len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return chosen

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self._watch()
        key, tried = prefix_key(request), set()
        last_error: APIError | None = None
        while True:
            try:
                replica = self.pick(key, tried)
            except APIError:
                if last_error is not None:
                    raise last_error from None  # every replica refused it: its own error
                raise
            replica.outstanding += 1
            started = False
            try:
                async for chunk in replica.gateway.generate(request):
                    started = True
                    yield chunk
                return
            except APIError as error:
                if started or error.status not in REFUSALS_ANOTHER_MAY_SERVE:
                    raise
                if isinstance(error, ReplicaUnreachable):
                    logger.warning("tritonserver replica %s unreachable, taken out: %s", replica.gateway.url, error)
                    replica.healthy = False
                tried.add(replica)
                last_error = error
            finally:
                replica.outstanding -= 1

    def _first_healthy(self) -> TritonGateway:
        self._watch()
        return next((r.gateway for r in self.replicas if r.healthy), self.replicas[0].gateway)

    async def model_names(self) -> list[str]:
        return await self._first_healthy().model_names()

    async def model_config(self, model: str) -> dict:
        return await self._first_healthy().model_config(model)

    async def is_ready(self) -> bool:
        await self._check_all()
        return any(r.healthy for r in self.replicas)

    async def _check(self, replica: Replica) -> None:
        try:
            ready = await asyncio.wait_for(replica.gateway.is_ready(), HEALTH_TIMEOUT)
        except (asyncio.TimeoutError, OSError):
            ready = False
        if ready != replica.healthy:
            logger.warning("tritonserver replica %s %s", replica.gateway.url,
                           "is back" if ready else "failed its health check, taken out")
        replica.healthy = ready

    async def _check_all(self) -> None:
        await asyncio.gather(*(self._check(r) for r in self.replicas))

    def _watch(self) -> None:
        """Health checks every HEALTH_INTERVAL, started in the serving event loop on first use."""
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_loop())

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL)
            await self._check_all()

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await asyncio.gather(*(r.gateway.close() for r in self.replicas))
