"""BLOOM greedy tokens equal transformers' in fp32."""
import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

from family_check import assert_matches_transformers
from tritonlm.layers.alibi import bloom_slopes

TINY = dict(hidden_size=64, n_layer=2, n_head=4, initializer_range=0.15)

VARIANTS = {
    "default": {},
    "residual-post-layernorm": {"apply_residual_connection_post_layernorm": True},
    "6-heads": {"hidden_size": 96, "n_head": 6},
    "untied": {"tie_word_embeddings": False},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_bloom_matches_transformers(tmp_path, smollm2_tokenizer, variant):
    config = BloomConfig(**{**TINY, **VARIANTS[variant]}, vocab_size=len(smollm2_tokenizer))
    assert_matches_transformers(tmp_path, BloomForCausalLM, config, smollm2_tokenizer)


@pytest.mark.parametrize("num_heads", [4, 6, 12, 16])
def test_bloom_slopes_equal_transformers(num_heads):
    assert torch.equal(bloom_slopes(num_heads), _get_alibi_slopes(num_heads, "cpu"))


def test_many_decodes_of_mixed_lengths_grouped_by_context(tmp_path, smollm2_tokenizer):
    # 24 rows of 1..47 prompt tokens: decode steps split them into context-length groups, each
    # with its own ALiBi distances.
    config = BloomConfig(**TINY, vocab_size=len(smollm2_tokenizer))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
               for n in range(1, 48, 2)]
    assert_matches_transformers(tmp_path, BloomForCausalLM, config, smollm2_tokenizer,
                                prompts=prompts, new_tokens=8)
