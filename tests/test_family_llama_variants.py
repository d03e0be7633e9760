"""The Llama family's variants (Llama rope schemes, Code Llama, Mistral's sliding window, Qwen2,
Gemma) give transformers' greedy tokens, alone and batched."""
import numpy as np
import pytest
import torch
from transformers import (GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from family_check import assert_matches_transformers
from tritonlm.layers.attention_metadata import AttentionSpec, StepLayout, build_metadata

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15)

LLAMA = (LlamaConfig, LlamaForCausalLM)
MISTRAL = (MistralConfig, MistralForCausalLM)
QWEN2 = (Qwen2Config, Qwen2ForCausalLM)
GEMMA = (GemmaConfig, GemmaForCausalLM)

VARIANTS = {
    "llama-untied": (LLAMA, {}),
    "llama-tied": (LLAMA, {"tie_word_embeddings": True}),
    "llama-multi-query": (LLAMA, {"num_key_value_heads": 1}),
    "llama-no-gqa-head-dim-32": (LLAMA, {"num_attention_heads": 2, "num_key_value_heads": 2}),
    "llama-rope-theta": (LLAMA, {"rope_theta": 500000.0}),
    "llama-rope-linear": (LLAMA, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-rope-llama3": (LLAMA, {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}}),
    "llama-rope-yarn": (LLAMA, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 128}}),
    "code-llama": (LLAMA, {"rope_theta": 1e6, "max_position_embeddings": 16384}),
    "mistral-sliding-window-7": (MISTRAL, {"sliding_window": 7}),
    "qwen2-untied": (QWEN2, {}),
    "qwen2-tied": (QWEN2, {"tie_word_embeddings": True}),
    # max_window_layers 0: every layer slides (HF windows the layers from max_window_layers on).
    "qwen2-sliding-window-7": (QWEN2, {"use_sliding_window": True, "sliding_window": 7,
                                       "max_window_layers": 0}),
    "gemma-head-dim-32": (GEMMA, {"head_dim": 32}),
    "gemma-multi-query": (GEMMA, {"head_dim": 32, "num_key_value_heads": 1}),
}


def with_random_norms(model_class):
    """HF starts RMSNorm weights at ones (Gemma: zeros); perturbed ones check how they apply."""
    def build(config):
        model = model_class(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(0.3 * torch.randn_like(param))
        return model
    return build


def tiny_config(config_class, tokenizer, **overrides):
    return config_class(**{**TINY, "vocab_size": len(tokenizer), **overrides})


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_transformers(tmp_path, smollm2_tokenizer, variant):
    (config_class, model_class), overrides = VARIANTS[variant]
    config = tiny_config(config_class, smollm2_tokenizer, **overrides)
    assert_matches_transformers(tmp_path, with_random_norms(model_class), config, smollm2_tokenizer)


def test_dynamic_ntk_rope_matches_transformers(tmp_path, smollm2_tokenizer):
    # Served up to max_position_embeddings * factor = 128: dynamic NTK exists to go past 32.
    config = tiny_config(LlamaConfig, smollm2_tokenizer, max_position_embeddings=32,
                         rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    # transformers keeps grown frequencies from one generate call to the next unless a prompt is
    # shorter than max_position_embeddings; alternating short prompts with long ones longer than
    # the previous request grew makes each reference equal a fresh model's. The short ones cross
    # 32 while decoding, the long ones are scaled from their prefill on.
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
               for n in (40, 20, 56, 10)]
    llm, _, _ = assert_matches_transformers(tmp_path, LlamaForCausalLM, config, smollm2_tokenizer,
                                            prompts=prompts)
    assert llm.engine.max_model_len == 128
    assert not llm.engine.block_manager.enable_prefix_caching  # keys depend on the length


def test_qwen2_mixed_windows_match_transformers(tmp_path, smollm2_tokenizer):
    """Full attention before max_window_layers, sliding after: each layer gets its own masks."""
    config = tiny_config(Qwen2Config, smollm2_tokenizer, num_hidden_layers=3,
                         use_sliding_window=True, sliding_window=7, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert_matches_transformers(tmp_path, with_random_norms(Qwen2ForCausalLM), config,
                                smollm2_tokenizer)


@pytest.mark.parametrize("use_flash,kernels", [(False, False), (True, False), (False, True)],
                         ids=["torch-metadata", "flash-metadata", "paged-kernel-metadata"])
def test_sequence_lengths_per_token(use_flash, kernels):
    """A decode at position 9, a prefill chunk of positions 3..7 and a new prompt of 2 tokens."""
    lens, starts = np.array([1, 5, 2]), np.array([9, 3, 0])
    first = np.cumsum(lens) - lens
    positions = np.repeat(starts - first, lens) + np.arange(lens.sum())
    tables = np.arange(6).reshape(3, 2)
    layout = StepLayout(lens, starts, first, positions, tables, block_size=8)
    meta = build_metadata(layout, AttentionSpec(num_kv_heads=1), use_flash, torch.from_numpy,
                          decode_kernel=kernels, prefill_kernel=kernels)
    assert meta.seq_lens.tolist() == [10, 8, 8, 8, 8, 8, 2, 2]


def test_many_decodes_of_mixed_lengths_grouped_by_context(tmp_path, smollm2_tokenizer):
    # The grouping itself: 32 decode rows with contexts 5..160 gather K/V in length groups, not
    # all padded to 160 (10 blocks of 16).
    lens, starts = np.ones(32, dtype=np.int64), np.arange(4, 160, 5, dtype=np.int64)
    tables = np.arange(32 * 10, dtype=np.int64).reshape(32, 10)
    layout = StepLayout(lens, starts, np.arange(32), starts.copy(), tables, 16)
    meta = build_metadata(layout, AttentionSpec(num_kv_heads=2), False, torch.from_numpy)
    assert len(meta.decode) > 1
    assert sorted(i for rows in meta.decode for i in rows.token_index.tolist()) == list(range(32))
    assert meta.decode[0].blocks.shape[-1] < 10 and meta.decode[-1].blocks.shape[-1] == 10
    # And greedy tokens over such groups equal transformers'.
    config = tiny_config(LlamaConfig, smollm2_tokenizer)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
               for n in range(1, 48, 2)]
    assert_matches_transformers(tmp_path, LlamaForCausalLM, config, smollm2_tokenizer,
                                prompts=prompts, new_tokens=8)
