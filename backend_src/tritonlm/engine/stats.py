"""What the engine reports to its observers (metrics, tracing): plain values, no torch."""
import logging
import time
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)


@dataclass
class RequestTimeline:
    """Wall-clock times (time.time()) of a request's phases."""
    arrival: float
    scheduled: float | None = None  # the start of the first step that computed any of it
    first_token: float | None = None
    finished: float | None = None
    detokenize_seconds: float = 0.0


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    timeline: RequestTimeline
    num_prompt_tokens: int
    num_output_tokens: int  # over all of its sequences
    finish_reason: str  # of its first sequence
    trace_parent: str | None  # W3C traceparent of the caller's trace, when one came with it
    num_draft_tokens: int = 0  # speculative tokens verified for it (all of its sequences)
    num_accepted_tokens: int = 0  # of which kept


@dataclass(frozen=True)
class StepStats:
    num_running: int
    num_waiting: int
    num_preempted_waiting: int  # waiting sequences that were preempted and will be recomputed
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int  # in this step
    prefix_cache_queries: int  # prompt tokens looked up in this step
    prefix_cache_hits: int  # of which found
    num_draft_tokens: int = 0  # speculative tokens verified in this step
    num_accepted_tokens: int = 0  # of which kept
    # LoRA adapters of the running and the waiting sequences (names, sorted)
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()


class EngineObserver(Protocol):
    def on_step(self, stats: StepStats) -> None: ...

    def on_request_finished(self, request: FinishedRequest) -> None: ...

    def on_request_error(self, kind: str) -> None:
        """kind: "invalid", "cancelled", "internal", "overloaded" (refused at
        max_concurrent_requests) or "timeout" (queue_timeout)."""


class RateLimitedWarning:
    """Logs a warning at most once per `interval` seconds."""

    def __init__(self, interval: float = 30.0):
        self.interval = interval
        self.last = float("-inf")

    def __call__(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            logger.warning(message, *args)
