"""A scheduled sequence as the plan's ScheduledChunk: its tokens (and proposals to verify), what its
draws may not pick (min_tokens' stops, bad words' last tokens) and what the runner must learn of
the sequence's history."""
from tritonlm.engine.sequence import Sequence
from tritonlm.engine.step_plan import SamplingRow, ScheduledChunk


def build_chunk(seq: Sequence, num_new: int, draft: list[int], admitted: bool,
                eos_token_ids: frozenset[int]) -> ScheduledChunk:
    """`seq`'s next `num_new` tokens, then `draft`: proposed tokens to verify; `admitted`: the
    sequence starts this step (on reused KV the runner has not seen the tokens before it)."""
    start = seq.num_computed_tokens
    sampling, draft_banned = None, ()
    if start + num_new == seq.num_tokens:  # it reaches its end: it samples
        sampling = SamplingRow(seq.params, seq.seed, seq.num_output_tokens,
                               banned_tokens(seq, eos_token_ids))
        draft_banned = tuple(banned_tokens(seq, eos_token_ids, draft[:j])
                             for j in range(1, len(draft) + 1))
    tracked = seq.params.uses_penalties
    history = seq.token_ids[:start] if tracked and admitted else []
    encoder = seq.encoder_token_ids or []
    targets = (seq.token_ids[start + 1:min(start + num_new + 1, seq.num_prompt_tokens)]
               if seq.needs_prompt_logprobs else [])
    return ScheduledChunk(
        seq.seq_id, seq.token_ids[start:start + num_new] + list(draft), start,
        list(seq.block_table),
        sampling, seq.num_prompt_tokens, tracked, history,
        encoder_token_ids=None if seq.encoder_computed or not encoder else list(encoder),
        cross_block_table=list(seq.cross_block_table), encoder_len=len(encoder),
        prompt_targets=targets, num_prompt_logprobs=seq.params.prompt_logprobs or 0,
        num_draft_tokens=len(draft), draft_banned=draft_banned, lora_id=seq.lora_id)


def banned_tokens(seq: Sequence, eos_token_ids: frozenset[int],
                  drafted: list[int] = ()) -> tuple[int, ...]:
    """Stop tokens until min_tokens is reached; the last token of any bad word whose other tokens
    the sequence has just produced; `drafted`: then these proposals."""
    p = seq.params
    banned = []
    if seq.num_output_tokens + len(drafted) < p.min_tokens:
        banned += p.stop_token_ids if p.ignore_eos else [*eos_token_ids, *p.stop_token_ids]
    if seq.bad_words_ids:
        tail = seq.token_ids[-max(map(len, seq.bad_words_ids)):] + list(drafted)
        for word in seq.bad_words_ids:
            if len(word) == 1 or tail[-(len(word) - 1):] == word[:-1]:
                banned.append(word[-1])
    return tuple(banned)
