"""Speculative decoding with a draft model (engine/draft_proposer.py): a converted repository with
the target's vocabulary proposes its greedy tokens from its own paged KV cache. Outputs must be
transformers' (greedy) and the engine's without speculation (sampled); the target itself as the
draft must have every proposal kept (its KV copy of each sequence stays right as the target keeps
some proposals and draws others, and its head's shortlist picks the head's own argmax); both
caches end empty."""
import pytest

from conftest import hf_greedy, run_convert
from family_check import random_prompts, reference_greedy, tiny_llama
from test_speculative import TASKS, assert_all_blocks_free, counters, repeating_prompts
from tritonlm import LLM, SamplingParams
from tritonlm.config import KV_CACHE_MEMORY_VARIABLE
from tritonlm.engine.block_manager import BlockManager
from tritonlm.engine.kv_cache_sizing import most_blocks_in_use
from tritonlm.layers import cpu_kernels
from tritonlm.layers.shortlist_head import ShortlistHead


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_tokenizer):
    """A tiny target, and another tiny model of the same vocabulary (other weights)."""
    hf, target = tiny_llama(tmp_path_factory.mktemp("draft"), smollm2_tokenizer)
    _, other = tiny_llama(tmp_path_factory.mktemp("other"), smollm2_tokenizer,
                          num_hidden_layers=1)
    return hf, target, other


def speculating(repo, draft, **settings) -> LLM:
    return LLM(str(repo), **{"speculative": str(draft), "num_speculative_tokens": 3,
                             "speculative_disable_by_batch_size": 16, "block_size": 8,
                             **settings})


def assert_shortlist_head(llm: LLM) -> None:
    """The draft's greedy tokens come through its head's shortlist where the kernels run."""
    if cpu_kernels.load() is not None:
        assert isinstance(llm.engine.scheduler.proposer.runner.greedy_head, ShortlistHead)


def assert_draft_cache_empty(llm: LLM) -> None:
    proposer = llm.engine.scheduler.proposer
    assert not proposer.mirrors and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_the_target_as_its_own_draft_has_every_proposal_kept(tiny):
    hf, target, _ = tiny
    llm = speculating(target, target)
    prompts = random_prompts(4, 2000, seed=11)
    lengths = [10, 17, 23, 30]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [reference_greedy(hf, p, n)
                                              for p, n in zip(prompts, lengths)]
    drafted, accepted = counters(llm)
    assert drafted == accepted > sum(lengths) / 2
    assert_shortlist_head(llm)
    assert_all_blocks_free(llm)
    assert_draft_cache_empty(llm)


def test_another_draft_keeps_outputs_with_preemption_and_cancellation(tiny):
    hf, target, other = tiny
    plain = LLM(str(target), block_size=8)
    llm = speculating(target, other, num_kv_blocks=20, max_num_seqs=6)
    prompts = repeating_prompts(6, seed=12)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == [
        reference_greedy(hf, p, 24) for p in prompts]
    assert llm.engine.scheduler.num_preemptions > 0 and counters(llm)[0] > 0
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=20, logprobs=1,
                              ignore_eos=True) for i in range(len(prompts))]
    for a, b in zip(llm.generate(prompts, sampled), plain.generate(prompts, sampled)):
        assert a.token_ids == b.token_ids
    assert_all_blocks_free(llm)
    assert_draft_cache_empty(llm)
    engine = llm.engine
    for i, prompt in enumerate(prompts[:3]):
        engine.add(engine.make_request(f"cut{i}", prompt, SamplingParams(
            temperature=0, max_tokens=200, ignore_eos=True)))
    drafted = counters(llm)[0]
    while counters(llm)[0] == drafted:
        engine.step()
    for i in range(3):
        engine.abort(f"cut{i}")
    assert_all_blocks_free(llm)
    assert_draft_cache_empty(llm)


def test_the_draft_reuses_its_cached_blocks_of_the_targets_tokens(tiny):
    """A prompt beginning as an earlier sequence (its prompt and part of its output) starts the
    draft from the blocks it cached for the tokens the target kept, not from blocks that held
    its refused proposals (a sampled run refuses some); the target as its own draft then keeps
    every proposal, which it would not from wrong KV."""
    hf, target, _ = tiny
    llm = speculating(target, target)
    proposer = llm.engine.scheduler.proposer
    runner, block_size = proposer.runner, proposer.blocks.block_size
    first_steps = []  # the tokens of each request's first draft step
    greedy_tokens = runner.greedy_tokens

    def recording(plan):
        if first_steps[-1] is None:  # each request appends None before it runs
            first_steps[-1] = sum(len(c.token_ids) for c in plan.chunks)
        return greedy_tokens(plan)
    runner.greedy_tokens = recording
    first = random_prompts(1, 2000, max_len=40, seed=21)[0][:30] * 2
    first_steps.append(None)
    sampled = llm.generate([first], SamplingParams(temperature=1.0, seed=3, max_tokens=24,
                                                   ignore_eos=True))[0].token_ids
    assert counters(llm)[0] > counters(llm)[1]  # some proposals refused
    second = first + sampled[:20] + [5, 6, 7]
    before = counters(llm)
    first_steps.append(None)
    output = llm.generate([second], SamplingParams(temperature=0, max_tokens=16,
                                                   ignore_eos=True))[0].token_ids
    assert output == reference_greedy(hf, second, 16)
    # the draft's first step: the prompt and the token the target drew after it; then only what
    # the blocks of the target's kept tokens (2 of the prompt, 1 of the output) leave
    reused = (len(first) + 20) // block_size * block_size
    assert reused > len(first) and first_steps == [len(first) + 1, len(second) + 1 - reused]
    drafted, accepted = (a - b for a, b in zip(counters(llm), before))
    assert drafted == accepted > 8, (drafted, accepted)
    assert_draft_cache_empty(llm)


def test_long_catch_ups_reach_the_draft_within_the_token_budget(tiny):
    """New mirrors' prompts beyond max_num_batched_tokens reach the draft in steps of at most
    that many tokens, as the target chunks its prefill; the target as its own draft keeps every
    proposal from the KV those steps leave."""
    hf, target, _ = tiny
    llm = speculating(target, target, max_num_batched_tokens=24)
    runner = llm.engine.scheduler.proposer.runner
    step_tokens = []
    greedy_tokens = runner.greedy_tokens

    def recording(plan):
        step_tokens.append(sum(len(c.token_ids) for c in plan.chunks))
        return greedy_tokens(plan)
    runner.greedy_tokens = recording
    prompts = [p * 3 for p in random_prompts(3, 2000, max_len=30, seed=31)]
    assert sum(map(len, prompts)) > 2 * 24
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [reference_greedy(hf, p, 12) for p in prompts]
    assert max(step_tokens) <= 24 and step_tokens.count(24) >= 2, step_tokens
    drafted, accepted = counters(llm)
    assert drafted == accepted > 0
    assert_draft_cache_empty(llm)


def test_mirrors_the_draft_cache_cannot_hold_wait_without_proposals(tiny, monkeypatch):
    """The draft's cache is sized by kv_cache_memory as any, not for every speculating sequence
    at its longest: mirrors that do not fit beside the others let go of their blocks and propose
    nothing that step. Outputs stay the greedy ones, and the target as its own draft keeps every
    proposal of the mirrors that come back."""
    hf, target, _ = tiny
    monkeypatch.setenv(KV_CACHE_MEMORY_VARIABLE, "1MiB")
    llm = speculating(target, target)
    proposer = llm.engine.scheduler.proposer
    runner, block_size = proposer.runner, proposer.blocks.block_size
    assert runner.num_blocks * runner.cache_slots.bytes_per_block() <= 1 << 20
    assert runner.num_blocks < most_blocks_in_use(16, proposer.max_len, block_size, 3)
    proposer.blocks = BlockManager(6, block_size)  # of its cache's blocks: ~2 mirrors' room
    steps = []  # (sequences that may speculate, mirrors that proposed)
    propose = proposer.propose

    def recording(seqs, limits):
        drafts = propose(seqs, limits)
        steps.append((sum(limit > 0 for limit in limits), sum(map(bool, drafts.values()))))
        return drafts
    proposer.propose = recording
    prompts = [p + p for p in random_prompts(4, 2000, max_len=20, seed=41)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [reference_greedy(hf, p, 16) for p in prompts]
    assert any(0 < proposed < speculating for speculating, proposed in steps), steps
    drafted, accepted = counters(llm)
    assert drafted == accepted > 0
    assert_draft_cache_empty(llm)


def test_a_draft_of_another_vocabulary_is_refused(tiny, tmp_path, smollm2_tokenizer):
    _, target, _ = tiny
    tokenizer = type(smollm2_tokenizer).from_pretrained(
        target / "1" / "weights")
    tokenizer.add_tokens(["<not-in-the-target>"])
    _, draft = tiny_llama(tmp_path, tokenizer)
    with pytest.raises(ValueError, match="another vocabulary"):
        speculating(target, draft)


def test_smollm2_with_its_int4_copy_as_draft(smollm2_repo, smollm2_hf, tmp_path_factory):
    """The natural draft: the same model quantized to 4 bits (a quarter of the bytes)."""
    draft = run_convert("default", tmp_path_factory.mktemp("int4"), "--quantize", "int4")
    llm = speculating(smollm2_repo, draft)
    tokenizer = llm.engine.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": task}],
                                             add_generation_prompt=True, return_dict=False)
               for task in TASKS[:2]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32,
                                                   ignore_eos=True))
    assert [o.token_ids for o in outputs] == [hf_greedy(smollm2_hf, p, 32) for p in prompts]
    drafted, accepted = counters(llm)
    assert accepted > drafted / 2, (accepted, drafted)
    assert_shortlist_head(llm)
    assert_draft_cache_empty(llm)
