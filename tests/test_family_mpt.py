"""MPT greedy tokens equal transformers' in fp32.

transformers ignores `no_bias`, `expansion_ratio` and `alibi_bias_max` (always bias-free, 4x MLP,
bias max 8); those variants check that tritonlm builds the same model it does."""
import pytest
import torch
from transformers import MptConfig, MptForCausalLM
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

from family_check import assert_matches_transformers
from tritonlm.layers.alibi import mpt_slopes

TINY = dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=128, initializer_range=0.15)

VARIANTS = {
    "default": {},
    "no-bias-false": {"no_bias": False},
    "clip-qkv": {"attn_config": {"clip_qkv": 0.3}},
    "softmax-scale": {"attn_config": {"softmax_scale": 0.5}},
    "alibi-bias-max-4": {"attn_config": {"alibi_bias_max": 4}},
    "6-heads": {"d_model": 96, "n_heads": 6},
    "expansion-ratio-2": {"expansion_ratio": 2},
    "untied": {"tie_word_embeddings": False},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_mpt_matches_transformers(tmp_path, smollm2_tokenizer, variant):
    config = MptConfig(**{**TINY, **VARIANTS[variant]}, vocab_size=len(smollm2_tokenizer))
    assert_matches_transformers(tmp_path, MptForCausalLM, config, smollm2_tokenizer)


@pytest.mark.parametrize("num_heads", [4, 6, 12, 16])
@pytest.mark.parametrize("bias_max", [8, 4])
def test_mpt_slopes_equal_transformers(num_heads, bias_max):
    # Over two keys the bias is [-slope, 0].
    bias = build_mpt_alibi_tensor(num_heads, 2, alibi_bias_max=bias_max)
    assert torch.equal(mpt_slopes(num_heads, bias_max), -bias[:, 0, 0])
