"""FLAN-T5 / T5 (encoder-decoder): greedy ids equal transformers' generate, alone and batched."""
import pytest
from transformers import T5Config, T5ForConditionalGeneration

from family_check import assert_matches_transformers, random_prompts
from tritonlm import SamplingParams

VARIANTS = {
    "flan-t5 (gated-gelu, untied)": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "t5 v1.0 (relu, tied, scaled output)": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    # transformers' own cache cannot hold more decoder than encoder layers (IndexError).
    "deeper encoder": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                           num_layers=3, num_decoder_layers=2),
    "few buckets, short max distance": dict(feed_forward_proj="gated-gelu",
                                            relative_attention_num_buckets=8,
                                            relative_attention_max_distance=16),
}


def tiny_t5_config(tokenizer, **overrides) -> T5Config:
    config = dict(vocab_size=len(tokenizer), d_model=64, d_kv=16, d_ff=128, num_layers=2,
                  num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                  initializer_factor=1.0)
    return T5Config(**{**config, **overrides})


@pytest.mark.parametrize("variant", VARIANTS)
def test_t5_matches_transformers(tmp_path, smollm2_tokenizer, variant):
    config = tiny_t5_config(smollm2_tokenizer, **VARIANTS[variant])
    assert_matches_transformers(tmp_path, T5ForConditionalGeneration, config, smollm2_tokenizer)


def test_t5_under_preemption_and_parallel_sampling(tmp_path, smollm2_tokenizer):
    """A cache too small for the batch preempts and recomputes (the encoder included); n > 1
    sequences share their request's cross-attention blocks."""
    config = tiny_t5_config(smollm2_tokenizer)
    llm, hf, prompts = assert_matches_transformers(
        tmp_path, T5ForConditionalGeneration, config, smollm2_tokenizer, num_prompts=6,
        num_kv_blocks=24, admission_headroom_blocks=0)
    assert llm.engine.scheduler.num_preemptions > 0
    sampled = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out, = llm.generate([prompts[0]], SamplingParams(n=3, **sampled))
    alone, = llm.generate([prompts[0]], SamplingParams(**sampled))
    assert out.choices[0].token_ids == alone.token_ids
    assert [len(c.token_ids) for c in out.choices] == [8, 8, 8]
    assert len({tuple(c.token_ids) for c in out.choices}) > 1
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_t5_prompt_is_the_encoder_input(tmp_path, smollm2_tokenizer):
    config = tiny_t5_config(smollm2_tokenizer)
    llm, _, _ = assert_matches_transformers(tmp_path, T5ForConditionalGeneration, config,
                                            smollm2_tokenizer, num_prompts=1, new_tokens=4)
    prompt = random_prompts(1, config.vocab_size, seed=5)[0]
    out, = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert out.prompt_token_ids == prompt and len(out.token_ids) == 3
