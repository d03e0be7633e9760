"""A draft model proposes: a smaller model with the target's vocabulary (a quantized copy of it,
say) runs greedy decode steps of its own, batched over the sequences that speculate, on its own
model runner and paged KV cache. Its proposals are its greedy tokens, so the target's
verification keeps each with the probability the target gives it (the point-mass rule, exact
for any sampling), as for prompt lookup."""
import logging
from pathlib import Path

from tritonlm.config import WEIGHTS_DIR, EngineConfig
from tritonlm.distributed import parallel_state
from tritonlm.engine.block_manager import BlockManager
from tritonlm.engine.model_runner import ModelRunner
from tritonlm.engine.sequence import Sequence
from tritonlm.engine.step_plan import SamplingRow, ScheduledChunk, StepPlan
from tritonlm.models.loader import load_config
from tritonlm.models.registry import context_limit, kv_depends_only_on_prefix
from tritonlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_GREEDY = SamplingRow(SamplingParams(temperature=0), seed=0, output_index=0, banned=())


class DraftModelProposer:
    def __init__(self, draft_dir: Path, config: EngineConfig, tokenizer):
        from tritonlm.engine.llm_engine import resolve_model_dir
        draft_dir = resolve_model_dir(draft_dir)
        weights = draft_dir / WEIGHTS_DIR
        hf_config = load_config(weights)
        draft_tokenizer_vocab = _vocab(weights)
        if draft_tokenizer_vocab != tokenizer.get_vocab():
            raise ValueError(f"the draft model {draft_dir} has another vocabulary than the "
                             "target's: it cannot propose the target's tokens")
        self.num_tokens = config.speculative_tokens
        self.token_budget = config.max_num_batched_tokens  # a step's tokens, as the target's
        self.max_len = min(config.max_model_len, context_limit(hf_config))
        draft = EngineConfig.load(draft_dir, device=config.device, max_model_len=self.max_len,
                                  max_num_seqs=config.speculative_disable_by_batch_size,
                                  enable_prefix_caching=config.enable_prefix_caching)
        if draft.tensor_parallel_size > 1:
            raise ValueError(f"the draft model {draft_dir} is converted for "
                             f"{draft.tensor_parallel_size} ranks: a draft runs on one (convert "
                             "it without --tp)")
        # Its cache is sized as any (ModelRunner._size_kv_cache); mirrors that do not fit wait
        # (_fitting).
        # One rank, whole, beside the target's first rank (vLLM's draft_tensor_parallel_size 1):
        # the other ranks only run the target's verification plans.
        with parallel_state.as_rank(0, 1):
            self.runner = ModelRunner(draft, hf_config, weights, draft=True)
        # Its own prefix cache (the target's setting): mirrors of prompts that begin alike (a
        # system prompt) compute that beginning once. Only blocks of the target's tokens are
        # hashed (_synced), never blocks holding the draft's proposals.
        self.blocks = BlockManager(self.runner.num_blocks, draft.block_size,
                                   draft.enable_prefix_caching
                                   and kv_depends_only_on_prefix(hf_config))
        # The draft's copy of each speculating sequence: the target's tokens, then its own
        # proposals; its KV is computed for a prefix of them.
        self.mirrors: dict[int, Sequence] = {}
        self.synced: dict[int, int] = {}  # the target's length when its mirror last took it
        logger.info("draft model %s (%s, %d KV blocks) proposes up to %d tokens a step",
                    draft_dir, draft.dtype, self.runner.num_blocks, self.num_tokens)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> dict[int, list[int]]:
        running = {seq.seq_id for seq in seqs}
        for seq_id in [i for i in self.mirrors if i not in running]:  # preempted
            self.release(seq_id)
        limits = {seq.seq_id: min(limit, self.num_tokens, self.max_len - seq.num_tokens)
                  for seq, limit in zip(seqs, limits)}
        active = self._fitting([self._synced(seq) for seq in seqs if limits[seq.seq_id] > 0],
                               limits)
        drafts = {mirror.seq_id: [] for mirror in active}
        self._prefill(active)
        plan = StepPlan([self._catch_up(mirror) for mirror in active])
        while active:
            steps = self.runner.greedy_tokens(plan)
            for i, mirror in enumerate(active):
                tokens = [step[i] for step in steps]
                # KV is now computed for the tokens the run fed: all but its last proposal.
                mirror.num_computed_tokens = mirror.num_tokens + len(tokens) - 1
                mirror.token_ids += tokens
                drafts[mirror.seq_id] += tokens
            active = [m for m in active if len(drafts[m.seq_id]) < limits[m.seq_id]]
            if active:
                plan = self._decode_run(active, min(limits[m.seq_id] - len(drafts[m.seq_id])
                                                    for m in active))
        return drafts

    def _fitting(self, mirrors: list[Sequence], limits: dict[int, int]) -> list[Sequence]:
        """The mirrors whose catch-up and proposals the cache holds beside the ones before them;
        the others let go of their blocks and propose nothing this step."""
        free = self.blocks.num_free_blocks
        fitting = []
        for mirror in mirrors:
            needed = self.blocks.num_missing_blocks(
                mirror, mirror.num_uncomputed_tokens + limits[mirror.seq_id])
            if needed <= free:
                free -= needed
                fitting.append(mirror)
            else:
                self.release(mirror.seq_id)
        return fitting

    def _prefill(self, active: list[Sequence]) -> None:
        """Computes the longest catch-ups (a new mirror's prompt) in steps of their own until
        the first proposal step holds no more than the token budget, as the target chunks its
        prefill; each keeps at least one token for that step."""
        while (total := sum(m.num_uncomputed_tokens for m in active)) > self.token_budget:
            mirror = max(active, key=lambda m: m.num_uncomputed_tokens)
            if mirror.num_uncomputed_tokens < 2:  # a budget under the batch: a token each
                break
            count = min(self.token_budget, total - self.token_budget,
                        mirror.num_uncomputed_tokens - 1)
            self.blocks.grow(mirror, count)
            start = mirror.num_computed_tokens
            self.runner.greedy_tokens(
                StepPlan([_chunk(mirror, mirror.token_ids[start:start + count])]))
            mirror.num_computed_tokens += count

    def _catch_up(self, mirror: Sequence) -> ScheduledChunk:
        """The first step of a proposal: the mirror's tokens not computed yet, then its first
        proposal."""
        # NOTE: _fitting left only mirrors whose growth the cache holds: grow never fails.
        new = mirror.num_uncomputed_tokens
        self.blocks.grow(mirror, new)
        # A few tokens to catch up on (the target kept every proposal, then drew one) run as
        # decode rows, as the target verifies: the decode kernels and programs rather than an
        # eager prefill step; the token drawn after the last is the one.
        rows = new - 1 if new <= self.num_tokens + 1 else 0
        return _chunk(mirror, mirror.token_ids[mirror.num_computed_tokens:], rows)

    def _decode_run(self, active: list[Sequence], steps: int) -> StepPlan:
        """The next `steps` proposals of `active` (each with only its last token uncomputed) as
        one decode run: each step's argmax is the next one's input without the host reading it
        in between (one step where the draft has no decode graphs to run it)."""
        if self.runner.decode_graphs is None:
            steps = 1
        for mirror in active:
            self.blocks.grow(mirror, steps)
        return StepPlan([_chunk(mirror, mirror.token_ids[-1:]) for mirror in active],
                        num_steps=steps)

    def release(self, seq_id: int) -> None:
        mirror = self.mirrors.pop(seq_id, None)
        if mirror is not None:
            self.blocks.free(mirror)
            del self.synced[seq_id]

    def _synced(self, seq: Sequence) -> Sequence:
        """The draft's copy of `seq` holding its tokens, its KV kept for their common prefix
        with the tokens it had: the target's tokens at the last sync, then the proposals that
        the target kept, if any."""
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = self.mirrors[seq.seq_id] = Sequence(
                seq.seq_id, seq.request_id, seq.token_ids, _GREEDY.params, 0, self.max_len)
            self.synced[seq.seq_id] = seq.num_tokens
            self.blocks.reuse_cached_prefix(mirror)
        common = self.synced[seq.seq_id]
        while (common < min(mirror.num_tokens, seq.num_tokens)
               and mirror.token_ids[common] == seq.token_ids[common]):
            common += 1
        mirror.token_ids[common:] = seq.token_ids[common:]
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, common)
        self.blocks.cache_full_blocks(mirror)  # its computed tokens are the target's now
        self.synced[seq.seq_id] = seq.num_tokens
        return mirror


def _chunk(mirror: Sequence, token_ids: list[int], num_draft_tokens: int = 0) -> ScheduledChunk:
    """A greedy step's chunk of `mirror`: `token_ids` from its first uncomputed position."""
    return ScheduledChunk(mirror.seq_id, token_ids, mirror.num_computed_tokens,
                          list(mirror.block_table), _GREEDY, mirror.num_prompt_tokens,
                          track_tokens=False, num_draft_tokens=num_draft_tokens)


def _vocab(weights: Path) -> dict[str, int]:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(weights).get_vocab()
