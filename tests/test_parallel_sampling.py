"""n and best_of: sequences of one request share the prompt's KV blocks (copy on write)."""
from tritonlm import SamplingParams
from tritonlm.engine.llm_engine import _SEED_STRIDE

SEED = 1234


def sampled(n=1, best_of=None, seed=SEED, max_tokens=10):
    return SamplingParams(temperature=1.5, top_p=0.98, seed=seed, max_tokens=max_tokens, n=n,
                          best_of=best_of, ignore_eos=True)


def prompt_of(tokenizer, length):
    ids = tokenizer.encode("The history of the Roman Empire spans many centuries " * 8)
    return ids[:length]


def test_n_sequences_share_prompt_blocks_and_equal_independent_runs(smollm2_llm,
                                                                     smollm2_tokenizer):
    engine = smollm2_llm.engine
    block_size = engine.config.block_size
    prompt = prompt_of(smollm2_tokenizer, 2 * block_size + 8)  # 2 full blocks and a partial one
    engine.add(engine.make_request("n3", prompt, sampled(n=3)))
    outputs = {}

    def step():
        for out in engine.step():
            for seq in out.sequences:
                outputs.setdefault(seq.index, []).extend(seq.token_ids)
    step()  # prefill and the first sequence's first token
    step()  # the other two join, sharing the prompt's blocks
    used = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    # 2 shared full blocks + a private copy of the partial block per sequence, instead of 3 * 3
    assert used == 2 + 3
    while engine.has_unfinished:
        step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for index in range(3):
        alone = smollm2_llm.generate([prompt], sampled(seed=(SEED + index * _SEED_STRIDE)
                                                       % (1 << 63)))[0]
        assert outputs[index] == alone.token_ids
    assert len({tuple(v) for v in outputs.values()}) == 3


def test_best_of_returns_the_n_most_likely(smollm2_llm, smollm2_tokenizer):
    prompt = prompt_of(smollm2_tokenizer, 20)

    def generate(params):
        # Each run prefills the whole prompt: a prefix-cache hit would prefill only its last
        # tokens, in float32 matmuls of fewer rows whose sums may differ in the last bits.
        smollm2_llm.engine.block_manager.reset_prefix_cache()
        return smollm2_llm.generate([prompt], params)[0]
    every = generate(sampled(n=4))
    best = generate(sampled(n=2, best_of=4))
    ranked = sorted(every.choices, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in best.choices] == [c.token_ids for c in ranked[:2]]
    assert [c.cumulative_logprob for c in best.choices] == [c.cumulative_logprob
                                                             for c in ranked[:2]]
