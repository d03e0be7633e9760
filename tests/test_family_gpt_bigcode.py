"""GPT-BigCode (SantaCoder, StarCoder) matches transformers with multi-query and multi-head attention."""
import pytest
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

from family_check import assert_matches_transformers

VARIANTS = {
    "multi_query": dict(multi_query=True),
    "multi_head": dict(multi_query=False),
    "unscaled_untied": dict(scale_attn_weights=False, tie_word_embeddings=False),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_gpt_bigcode_matches_transformers(tmp_path, smollm2_tokenizer, variant):
    config = GPTBigCodeConfig(vocab_size=len(smollm2_tokenizer), n_embd=64, n_inner=128, n_layer=2,
                              n_head=4, n_positions=256, initializer_range=0.15,
                              bos_token_id=1, eos_token_id=2, **VARIANTS[variant])
    assert_matches_transformers(tmp_path, GPTBigCodeForCausalLM, config, smollm2_tokenizer)
