"""The engine with the kernels the model runner picks on CUDA without flash-attn (the Triton decode
kernel for decodes, SDPA for prefill), run here by Triton's CPU interpreter: greedy tokens equal
transformers' for grouped-query, multi-query, sliding-window and ALiBi models, alone and batched."""
import pytest
from transformers import (BloomConfig, BloomForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM)

from family_check import assert_matches_transformers
from tritonlm.engine.model_runner import ModelRunner
from tritonlm.layers import triton_paged_attention
from tritonlm.layers.attention import PagedKernels

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15)
MODELS = {
    "llama-gqa": (LlamaForCausalLM, LlamaConfig, LLAMA),
    "llama-multi-query": (LlamaForCausalLM, LlamaConfig, {**LLAMA, "num_key_value_heads": 1}),
    "mistral-sliding-window-7": (MistralForCausalLM, MistralConfig, {**LLAMA, "sliding_window": 7}),
    "bloom-alibi": (BloomForCausalLM, BloomConfig,
                    dict(hidden_size=64, n_layer=2, n_head=4, initializer_range=0.15)),
}


@pytest.mark.parametrize("model", MODELS)
def test_triton_decode_kernel_gives_transformers_tokens(tmp_path, smollm2_tokenizer, monkeypatch,
                                                        model):
    picked = []

    def cuda_kernels(runner):
        picked.append(runner)
        return PagedKernels(decode=triton_paged_attention.decode_attention)

    monkeypatch.setattr(ModelRunner, "_paged_kernels", cuda_kernels)
    model_class, config_class, settings = MODELS[model]
    config = config_class(**settings, vocab_size=len(smollm2_tokenizer))
    llm, _, _ = assert_matches_transformers(tmp_path, model_class, config, smollm2_tokenizer,
                                            new_tokens=12)
    (runner,) = picked
    assert runner is llm.engine.runner
    assert all(layer.kernels.decode is triton_paged_attention.decode_attention
               for layer in runner.attention_layers)
