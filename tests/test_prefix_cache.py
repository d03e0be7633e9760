"""Prefix caching is exact: the same tokens with and without it, penalties included."""
import pytest

from tritonlm import LLM, SamplingParams

SYSTEM = ("You are a careful assistant. Answer in one short sentence, mention the subject by name, "
          "avoid lists, and never apologise. Today is a quiet day in a small town by the sea.")
QUESTIONS = ["What colour is the sky?", "Name a large animal.", "What do bees make?",
             "Where do fish live?"]


@pytest.fixture(scope="module")
def uncached(smollm2_repo):
    return LLM(str(smollm2_repo), enable_prefix_caching=False, num_kv_blocks=128)


def chats(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": q}],
                                          add_generation_prompt=True, return_dict=False)
            for q in QUESTIONS]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                   frequency_penalty=0.5),
    SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
], ids=["greedy", "penalties", "seeded"])
def test_cached_prefixes_give_the_same_tokens(smollm2_repo, smollm2_tokenizer, uncached, params):
    cached = LLM(str(smollm2_repo), num_kv_blocks=128)
    prompts = chats(smollm2_tokenizer)
    blocks = cached.engine.block_manager
    first = cached.generate(prompts[:1], params)  # fills the cache with the shared prefix
    rest = cached.generate(prompts[1:], params)
    assert cached.engine.scheduler.prefix_cache_hits >= 3 * (len(prompts[0]) // 2 // blocks.block_size) * \
        blocks.block_size  # at least the shared system prompt's full blocks, three times
    reference = uncached.generate(prompts, params)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in reference]
    assert uncached.engine.scheduler.prefix_cache_hits == 0
    assert blocks.num_free_blocks == blocks.num_blocks
