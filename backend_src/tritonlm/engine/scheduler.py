"""Iteration-level scheduling: one token budget per step covers prefill chunks and decodes alike."""
from collections import deque

from tritonlm.engine.block_manager import BlockManager
from tritonlm.engine.chunk_builder import build_chunk
from tritonlm.engine.sequence import FinishReason, Sequence, SequenceStatus
from tritonlm.engine.speculation import Proposer
from tritonlm.engine.step_plan import SampledToken, StepPlan


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, eos_token_ids: frozenset[int],
                 max_decode_run: int = 1, proposer: Proposer | None = None,
                 max_speculating_batch: int = 0, max_loras: int = 1,
                 headroom_blocks: int = 0):
        """`max_decode_run`: the most decode steps one plan may ask for in a row (StepPlan.
        num_steps); 1 where the runner cannot chain them. `proposer`: drafts for speculative
        decoding while fewer than `max_speculating_batch` sequences run. `max_loras`: distinct
        adapters the running batch may use; a request of another waits. `headroom_blocks`: blocks
        of output kept free for each running sequence before a waiting one starts (see
        _blocks_to_come)."""
        self.block_manager = block_manager
        self.headroom_blocks = headroom_blocks
        self.max_decode_run = max_decode_run
        self.proposer, self.max_speculating_batch = proposer, max_speculating_batch
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last is preempted first
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache at admission, and those found there.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_draft_tokens = 0  # proposed for verification
        self.num_accepted_tokens = 0  # of which the target sampled the same
        self._finished_ids: list[int] = []
        self.blocked_by_cache = False  # the last schedule() left requests waiting for blocks

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Queue `child` first in line, sharing the KV of `parent`'s prompt but its last token,
        which the child computes itself to sample its own first token."""
        self.block_manager.share(parent, child, parent.num_prompt_tokens - 1)
        self.waiting.appendleft(child)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """Pick this step's work: running sequences first, then waiting ones in arrival order."""
        plan = StepPlan(finished_seq_ids=self._finished_ids)
        self._finished_ids = []
        drafts = self._proposals()
        plan.num_steps = 1 if drafts else self._decode_run_length()
        if plan.num_steps > 1:
            self.blocked_by_cache = False
            for seq in self.running:
                self._schedule_chunk(seq, 1, plan, num_slots=plan.num_steps)
            return plan
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, num_new, plan):
                break  # seq itself was preempted: nothing admitted after it either
            index += 1
            draft = drafts.get(seq.seq_id, [])[:budget - num_new]
            if not self.block_manager.can_grow(seq, num_new + len(draft)):
                draft = []  # speculation never preempts
            budget -= self._schedule_chunk(seq, num_new, plan, draft=draft)
        self.blocked_by_cache = bool(plan.preempted_seq_ids)
        if not plan.preempted_seq_ids:
            # Prompt blocks that running prefills are about to compute: a request needing one
            # waits for it to reach the prefix cache rather than compute it a second time.
            in_flight = {h for s in self.running
                         for h in self.block_manager.pending_block_hashes(s)} \
                if self.waiting else set()
            adapters = {s.lora_id for s in self.running} - {0}
            # (not summed while a full batch keeps every waiting request out)
            headroom = (sum(self._blocks_to_come(s) for s in self.running)
                        if self.waiting and len(self.running) < self.max_num_seqs else 0)
            passed: list[Sequence] = []  # of adapters the batch has no room for: they wait
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if seq.lora_id and seq.lora_id not in adapters and len(adapters) >= self.max_loras:
                    passed.append(self.waiting.popleft())
                    continue
                encoding = 0 if seq.encoder_computed else len(seq.encoder_token_ids or ())
                if encoding >= budget and plan.chunks:
                    break  # the encoder runs in one piece: in a step of its own if need be
                # NOTE: prompt logprobs need the whole prompt computed: no cached prefix.
                reused = (None if seq.needs_prompt_logprobs
                          else self.block_manager.reuse_cached_prefix(seq))
                if reused is not None and self.block_manager.next_block_hash(seq) in in_flight:
                    self._release(seq)
                    break
                num_new = min(seq.num_uncomputed_tokens, max(budget - encoding, 1))
                if not (self._blocks_to_come(seq) + headroom <= self.block_manager.num_free_blocks
                        if self.running else self.block_manager.can_grow(seq, num_new)):
                    self._release(seq)  # looked up again when it is admitted
                    self.blocked_by_cache = True
                    break
                if reused is not None:
                    self.prefix_cache_queries += seq.num_tokens
                    self.prefix_cache_hits += reused
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                in_flight.update(self.block_manager.pending_block_hashes(seq))
                if seq.lora_id:
                    adapters.add(seq.lora_id)
                budget -= encoding + self._schedule_chunk(seq, num_new, plan, admitted=True)
                headroom += self._blocks_to_come(seq)
            self.waiting.extendleft(reversed(passed))
        if plan.is_empty:  # the runner sees finished sequences with the next real step
            self._finished_ids = plan.finished_seq_ids
        return plan

    def _proposals(self) -> dict[int, list[int]]:
        """Draft tokens for the decoding sequences that may speculate, when the batch is small
        enough for a step to be bound by reading the weights rather than by compute. A sequence
        proposes at most twice the tokens its last verification kept, plus two: each proposal
        costs a row of compute, and where the output stopped copying they are mostly wasted
        (SmolLM2 editing code at batch 1 on 2 Cascade Lake cores: 4 drafts a step 13.9 ms a
        token, this rule 12.7, no speculation 20.4)."""
        if self.proposer is None:
            return {}
        limits = [0] * len(self.running)  # none: the proposer only lets finished ones go
        if len(self.running) < self.max_speculating_batch:
            for i, seq in enumerate(self.running):
                # the last token to generate needs no proposal: it is drawn anyway
                room = seq.max_total_tokens - seq.num_tokens - 1
                if seq.last_accepted is not None:
                    room = min(room, 2 * seq.last_accepted + 2)
                if seq.num_uncomputed_tokens == 1 and self._may_speculate(seq):
                    limits[i] = room
        drafts = self.proposer.propose(self.running, limits)
        return {seq_id: draft for seq_id, draft in drafts.items() if draft}

    @staticmethod
    def _may_speculate(seq: Sequence) -> bool:
        """A verification row draws as the decode step it stands for: its banned tokens (bad
        words, min_tokens), token counts (penalties) and grammar mask follow the proposals
        before it; a watermark's green list is seeded by its own input token."""
        return seq.params.speculative and seq.encoder_token_ids is None

    def _decode_run_length(self) -> int:
        """How many decode steps the running batch may take in a row: as many as the run may
        have (max_decode_run) while no sequence reaches its token limit before the last, when
        every sequence decodes, none samples by what the host must see first (its tokens so far:
        grammar, penalties, bad words, min_tokens, watermark), no waiting request could join now
        (a full batch runs on: a request waiting for its slot gets it after the run) and the
        blocks for every step are free now; else 1."""
        if self.max_decode_run == 1 or not self.running:
            return 1
        if self.waiting and len(self.running) < self.max_num_seqs:
            return 1
        # (the decode graphs a run replays know no adapters)
        if not all(seq.num_uncomputed_tokens == 1 and self._samples_on_device(seq)
                   and not seq.lora_id for seq in self.running):
            return 1
        steps = min(self.max_decode_run,
                    min(seq.max_total_tokens - seq.num_tokens for seq in self.running))
        missing = sum(self.block_manager.num_missing_blocks(seq, steps) for seq in self.running)
        return steps if steps > 1 and missing <= self.block_manager.num_free_blocks else 1

    def _samples_on_device(self, seq: Sequence) -> bool:
        """Its next draws need nothing the host computes from the tokens before them (a
        watermark's green list comes from the host)."""
        return not seq.params.watermark and self._draws_need_no_history(seq)

    @staticmethod
    def _draws_need_no_history(seq: Sequence) -> bool:
        """No grammar, penalties, bad words or min_tokens still to reach: its draws do not
        depend on the tokens drawn just before them."""
        p = seq.params
        return (p.constraint is None and not p.uses_penalties and not seq.bad_words_ids
                and seq.num_output_tokens >= p.min_tokens)

    def _make_room(self, seq: Sequence, num_new: int, plan: StepPlan) -> bool:
        """Preempt the most recently admitted sequences until `seq` fits; False if seq went too."""
        while not self.block_manager.can_grow(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            plan.preempted_seq_ids.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _blocks_to_come(self, seq: Sequence) -> int:
        """The blocks `seq` still lacks for its uncomputed tokens and `headroom_blocks` blocks of
        output beyond them (fewer near its token limit). While sequences run, a waiting one
        starts only if the free blocks hold this for it and for each of them: starting whatever
        fits now (vLLM's rule) leaves a full cache no room to grow, and each preemption throws
        away a prompt's KV to recompute. SmolLM2, 256 requests of 32..512 tokens in and out,
        1 GiB cache (Zen 4): 103 preemptions, 18% more tokens run; with 2 blocks none, and 1.1x
        the throughput (1 block: 7 preemptions)."""
        growth = min(self.headroom_blocks * self.block_manager.block_size,
                     seq.max_total_tokens - seq.num_tokens)
        return self.block_manager.num_missing_blocks(seq, seq.num_uncomputed_tokens + growth)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        # Recompute later: the prompt and the tokens generated so far are prefilled again
        # (what the prefix cache still holds is reused).
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _schedule_chunk(self, seq: Sequence, num_new: int, plan: StepPlan,
                        admitted: bool = False, num_slots: int | None = None,
                        draft: list[int] = ()) -> int:
        """`num_slots`: the KV slots to give it, when more than its `num_new` tokens (a run);
        `draft`: proposed tokens to verify after them. Returns the tokens it computes."""
        copy = self.block_manager.grow(seq, num_slots or num_new + len(draft))
        if copy is not None:
            plan.block_copies.append(copy)
        plan.chunks.append(build_chunk(seq, num_new, list(draft), admitted, self.eos_token_ids))
        return num_new + len(draft)

    def update(self, plan: StepPlan, sampled: dict[int, SampledToken],
               prompt_logprobs: dict[int, list[SampledToken]] | None = None,
               step: int = 0) -> list[Sequence]:
        """Apply a step's results (seq_id -> new token, and prompt logprobs where asked), or
        those of `step` > 0: a run's later step, or the tokens sampled after the draft tokens of
        a verification, each applied while the draft before it was accepted; returns the
        sequences that grew."""
        grown = []
        by_id = {seq.seq_id: seq for seq in self.running}
        for chunk in plan.chunks:
            seq = by_id.get(chunk.seq_id)
            if seq is None:  # aborted while the step ran, or finished earlier in the run
                continue
            verified = len(chunk.token_ids) - chunk.num_draft_tokens  # tokens not proposed
            if step == 0:
                if chunk.prompt_targets:
                    seq.add_prompt_logprobs(chunk.start_pos, prompt_logprobs[chunk.seq_id])
                seq.num_computed_tokens += verified
                seq.encoder_computed = seq.encoder_token_ids is not None
                seq.num_draft_tokens += chunk.num_draft_tokens
                if chunk.num_draft_tokens:
                    seq.last_accepted = 0
                self.num_draft_tokens += chunk.num_draft_tokens
            else:
                # Every step so far applied, and its token was the draft this step follows.
                if (chunk.seq_id not in sampled
                        or seq.num_tokens != chunk.start_pos + verified + step
                        or (chunk.num_draft_tokens
                            and seq.token_ids[-1] != chunk.token_ids[verified + step - 1])):
                    continue
                seq.num_computed_tokens += 1
            self.block_manager.cache_full_blocks(seq)
            if chunk.sampling is None:
                continue
            result = sampled[chunk.seq_id]
            if step < chunk.num_draft_tokens and result.token == chunk.token_ids[verified + step]:
                seq.num_accepted_tokens += 1
                seq.last_accepted += 1
                self.num_accepted_tokens += 1
            seq.append(result)
            grown.append(seq)
            reason, stop_reason = self._token_finish_reason(seq, result.token)
            if reason:
                self.finish(seq, reason, stop_reason)
        return grown

    def _token_finish_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        """(finish reason, stop reason): an EOS token stops with stop reason None, a stop token
        with its id (vLLM's meaning)."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                return FinishReason.STOP, None
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
        if seq.num_tokens >= seq.max_total_tokens:
            return FinishReason.LENGTH, None
        needed = self.block_manager.blocks_for(seq.num_tokens) + len(seq.cross_block_table)
        if needed > self.block_manager.num_blocks:
            return FinishReason.LENGTH, None  # the whole KV cache could not hold one more token
        return None, None

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End `seq` (finished or aborted) and free its blocks at once; `stop_reason`: the stop
        string or token id that ended it."""
        if seq.is_finished:
            return
        seq.stop_reason = stop_reason
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._finished_ids.append(seq.seq_id)
