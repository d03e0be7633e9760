"""OPT and Galactica match transformers: pre- and post-layer-norm, projected embeddings, gelu."""
import pytest
from transformers import OPTConfig, OPTForCausalLM

from family_check import assert_matches_transformers

VARIANTS = {
    "default": dict(),
    "post_layer_norm": dict(do_layer_norm_before=False),  # opt-350m
    "project_in_out": dict(word_embed_proj_dim=32),
    "galactica": dict(activation_function="gelu"),  # learned positions, no projection
    "no_bias_no_affine_untied": dict(enable_bias=False, layer_norm_elementwise_affine=False,
                                     tie_word_embeddings=False),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_opt_matches_transformers(tmp_path, smollm2_tokenizer, variant):
    config = OPTConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, ffn_dim=128,
                       num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                       init_std=0.15, **{"word_embed_proj_dim": 64, **VARIANTS[variant]})
    assert_matches_transformers(tmp_path, OPTForCausalLM, config, smollm2_tokenizer)
