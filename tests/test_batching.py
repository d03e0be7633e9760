"""Continuous batching does not change results: together equals one at a time, preemption too."""
import pytest

from tritonlm import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Name a primary color.", "How many legs does a spider have?",
    "Write a haiku about autumn.", "What is 12 times 12?", "Translate 'thank you' to Spanish.",
    "Who wrote Hamlet?", "Give me a synonym for happy.", "What is the boiling point of water?",
    "Describe the moon in one sentence.", "What does a bee make?", "Suggest a name for a cat.",
    "What is the largest ocean?", "List two fruits.", "Why is the sky blue?", "Say hello in French.",
]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True, return_dict=False)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def one_at_a_time(smollm2_llm, prompts):
    return [smollm2_llm.generate([p], PARAMS)[0].token_ids for p in prompts]


def test_sixteen_prompts_together_equal_one_at_a_time(smollm2_llm, prompts, one_at_a_time):
    together = smollm2_llm.generate(prompts, PARAMS)
    assert [o.token_ids for o in together] == one_at_a_time


def test_preemption_under_a_tiny_kv_cache_keeps_results(smollm2_repo, prompts, one_at_a_time,
                                                        caplog):
    llm = LLM(str(smollm2_repo), num_kv_blocks=24, block_size=16, admission_headroom_blocks=0)
    with caplog.at_level("WARNING"):
        outputs = llm.generate(prompts, PARAMS)
    assert llm.engine.scheduler.num_preemptions > 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("preempted" in w and "KV cache of 24 blocks" in w for w in warnings)
    assert any("KV cache exhausted" in w for w in warnings)
    assert len(warnings) == 2  # rate-limited, not one per step
    assert [o.token_ids for o in outputs] == one_at_a_time
    assert llm.engine.block_manager.num_free_blocks == 24


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(smollm2_llm, prompts):
    seeded = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234, max_tokens=24)
    alone = smollm2_llm.generate([prompts[0]], seeded)[0].token_ids
    mixed = [seeded] + [SamplingParams(temperature=1.0, seed=i, max_tokens=24) for i in range(15)]
    in_batch = smollm2_llm.generate(prompts, mixed)[0].token_ids
    assert in_batch == alone
    other_seed = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=99, max_tokens=24)
    assert smollm2_llm.generate([prompts[0]], other_seed)[0].token_ids != alone
