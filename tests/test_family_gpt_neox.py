"""GPT-NeoX (Pythia) matches transformers: parallel and sequential residual, partial and full rotary."""
import pytest
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from family_check import assert_matches_transformers

VARIANTS = {
    "parallel_residual": dict(use_parallel_residual=True),
    "sequential_residual": dict(use_parallel_residual=False),
    "rotary_pct_0.25": dict(rotary_pct=0.25),
    "rotary_pct_1.0": dict(rotary_pct=1.0),
    "tied_without_attention_bias": dict(tie_word_embeddings=True, attention_bias=False),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_gpt_neox_matches_transformers(tmp_path, smollm2_tokenizer, variant):
    config = GPTNeoXConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, initializer_range=0.15,
                           max_position_embeddings=256, **VARIANTS[variant])
    assert_matches_transformers(tmp_path, GPTNeoXForCausalLM, config, smollm2_tokenizer)
