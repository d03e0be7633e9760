"""Falcon greedy tokens equal transformers' in fp32, for each of the family's layouts."""
import pytest
from transformers import FalconConfig, FalconForCausalLM

from family_check import assert_matches_transformers

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.15)

VARIANTS = {
    "7b-multi-query-parallel": {},
    "40b-new-decoder-architecture": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "40b-one-norm": {"new_decoder_architecture": True, "num_kv_heads": 2,
                     "num_ln_in_parallel_attn": 1},
    "alibi": {"alibi": True, "multi_query": False, "parallel_attn": False, "bias": True},
    "alibi-multi-query-12-heads": {"alibi": True, "hidden_size": 96, "num_attention_heads": 12},
    "bias": {"bias": True},
    "sequential": {"parallel_attn": False, "multi_query": False},
    "untied": {"tie_word_embeddings": False},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_falcon_matches_transformers(tmp_path, smollm2_tokenizer, variant):
    config = FalconConfig(**{**TINY, **VARIANTS[variant]}, vocab_size=len(smollm2_tokenizer))
    assert_matches_transformers(tmp_path, FalconForCausalLM, config, smollm2_tokenizer)
