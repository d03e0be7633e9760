"""GPT-NeoX (Pythia) matches transformers: parallel and sequential residual, partial and full
rotary, dynamic NTK over a partial rotary."""
import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from family_check import assert_matches_transformers

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            initializer_range=0.15, max_position_embeddings=256)

VARIANTS = {
    "parallel_residual": dict(use_parallel_residual=True),
    "sequential_residual": dict(use_parallel_residual=False),
    "rotary_pct_0.25": dict(rotary_pct=0.25),
    "rotary_pct_1.0": dict(rotary_pct=1.0),
    "tied_without_attention_bias": dict(tie_word_embeddings=True, attention_bias=False),
}


def tiny_config(tokenizer, **overrides) -> GPTNeoXConfig:
    return GPTNeoXConfig(**{**TINY, "vocab_size": len(tokenizer), **overrides})


@pytest.mark.parametrize("variant", VARIANTS)
def test_gpt_neox_matches_transformers(tmp_path, smollm2_tokenizer, variant):
    config = tiny_config(smollm2_tokenizer, **VARIANTS[variant])
    assert_matches_transformers(tmp_path, GPTNeoXForCausalLM, config, smollm2_tokenizer)


def test_gpt_neox_dynamic_ntk_partial_rotary_matches_transformers(tmp_path, smollm2_tokenizer):
    config = tiny_config(smollm2_tokenizer, rotary_pct=0.25, max_position_embeddings=32,
                         rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    # Prompt lengths as in test_family_llama_variants' dynamic NTK test, which says why they keep
    # transformers' reference equal to a fresh model's: some cross 32 while decoding, some start past.
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
               for n in (40, 20, 56, 10)]
    llm, _, _ = assert_matches_transformers(tmp_path, GPTNeoXForCausalLM, config,
                                            smollm2_tokenizer, prompts=prompts)
    assert llm.engine.max_model_len == 128  # max_position_embeddings * factor
