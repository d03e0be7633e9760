"""What the engine tells its observers (metrics, tracing) and its log: after every step, for every
finished request and for every request that failed outside the step loop."""
import logging

from tritonlm.engine.block_manager import BlockManager
from tritonlm.engine.request_state import RequestState
from tritonlm.engine.scheduler import Scheduler
from tritonlm.engine.stats import EngineObserver, FinishedRequest, RateLimitedWarning, StepStats

logger = logging.getLogger(__name__)


class EngineReports:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager,
                 lora_names: dict[int, str]):
        self.scheduler, self.blocks, self.lora_names = scheduler, block_manager, lora_names
        self.observers: list[EngineObserver] = []
        self._warn_preemption = RateLimitedWarning()
        self._warn_cache_full = RateLimitedWarning()
        # Prefix cache queries and hits, draft and accepted tokens already sent to observers
        self._reported_counts = (0, 0, 0, 0)

    def step(self, plan) -> None:
        scheduler, blocks = self.scheduler, self.blocks
        if plan.preempted_seq_ids:
            self._warn_preemption("preempted %d sequences (%d in all): the KV cache of %d blocks "
                                  "is too small for this load", len(plan.preempted_seq_ids),
                                  scheduler.num_preemptions, blocks.num_blocks)
        if scheduler.blocked_by_cache:
            self._warn_cache_full("KV cache exhausted: %d requests wait for free blocks",
                                  len(scheduler.waiting))
        if not self.observers:
            return
        totals = (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits,
                  scheduler.num_draft_tokens, scheduler.num_accepted_tokens)
        since = [total - reported for total, reported in zip(totals, self._reported_counts)]
        self._reported_counts = totals
        stats = StepStats(len(scheduler.running), len(scheduler.waiting),
                          sum(s.num_output_tokens > 0 for s in scheduler.waiting),
                          blocks.num_blocks - blocks.num_free_blocks, blocks.num_blocks,
                          len(plan.preempted_seq_ids), *since,
                          self._adapter_names(scheduler.running),
                          self._adapter_names(scheduler.waiting))
        for observer in self.observers:
            observer.on_step(stats)

    def finished(self, state: RequestState) -> None:
        timeline = state.timeline
        finished = FinishedRequest(state.request_id, timeline, state.num_prompt_tokens,
                                   sum(s.num_output_tokens for s in state.seqs),
                                   state.seqs[0].finish_reason, state.trace_parent,
                                   sum(s.num_draft_tokens for s in state.seqs),
                                   sum(s.num_accepted_tokens for s in state.seqs))
        ttft = timeline.first_token - timeline.arrival if timeline.first_token else float("nan")
        drafts, lora_id = finished.num_draft_tokens, state.seqs[0].lora_id
        logger.info("request %s finished: reason=%s prompt_tokens=%d output_tokens=%d "
                    "ttft=%.3fs total=%.3fs free_blocks=%d/%d%s", state.request_id,
                    finished.finish_reason, finished.num_prompt_tokens, finished.num_output_tokens,
                    ttft, timeline.finished - timeline.arrival,
                    self.blocks.num_free_blocks, self.blocks.num_blocks,
                    (f" draft_tokens={drafts} accepted={finished.num_accepted_tokens} "
                     f"({finished.num_accepted_tokens / drafts:.0%})" if drafts else "")
                    + (f" lora={self.lora_names[lora_id]}" if lora_id else ""))
        for observer in self.observers:
            observer.on_request_finished(finished)

    def error(self, kind: str) -> None:
        for observer in self.observers:
            observer.on_request_error(kind)

    def _adapter_names(self, seqs) -> tuple[str, ...]:
        return tuple(sorted({self.lora_names[s.lora_id] for s in seqs if s.lora_id}))
