"""The decode path the model runner takes on CUDA without flash-attn, run here on CPU: the Triton
paged decode kernel (under Triton's CPU interpreter) for decodes, SDPA for prompts, and decode
steps through the CUDA-graph buffers (engine/decode_graphs.py), which off CUDA run eagerly (no GPU
here, so nothing is captured). Greedy tokens must equal transformers' for grouped-query,
sliding-window and ALiBi models at every batch size (padded up to a bucket), and padding rows must
not touch any sequence's blocks (the batched run reuses the prefix-cached blocks of the single
ones)."""
import pytest
import torch
from transformers import (BloomConfig, BloomForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM)

from family_check import assert_matches_transformers, random_prompts, reference_greedy
from tritonlm import SamplingParams
from tritonlm.engine import model_runner
from tritonlm.engine.decode_graphs import DecodeGraphs, batch_buckets
from tritonlm.engine.decode_run import CUDA_DECODE_RUN
from tritonlm.engine.model_runner import ModelRunner
from tritonlm.engine.step_plan import ScheduledChunk
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


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]), (6, [1, 2, 4, 6]), (20, [1, 2, 4, 8, 16, 20]),
    (256, [1, 2, 4, *range(8, 257, 8)])])
def test_buckets_are_vllms(max_num_seqs, expected):
    assert batch_buckets(max_num_seqs) == expected


def use_cuda_kernels(monkeypatch):
    monkeypatch.setattr(model_runner, "paged_kernels",
                        lambda *setup: PagedKernels(decode=triton_paged_attention.decode_attention))


@pytest.mark.parametrize("model", MODELS)
def test_triton_decode_kernel_gives_transformers_tokens(tmp_path, smollm2_tokenizer, monkeypatch,
                                                        model):
    use_cuda_kernels(monkeypatch)
    model_class, config_class, settings = MODELS[model]
    config = config_class(**settings, vocab_size=len(smollm2_tokenizer))
    llm, _, _ = assert_matches_transformers(tmp_path, model_class, config, smollm2_tokenizer,
                                            num_prompts=3, new_tokens=8,
                                            enforce_eager=True)  # no graphs on a GPU either
    runner = llm.engine.runner
    assert runner.decode_graphs is None and runner.inputs.kernels["decode_kernel"]
    assert all(layer.kernels.decode is triton_paged_attention.decode_attention
               for layer in runner.attention_layers)


@pytest.fixture
def graphed(monkeypatch):
    """The runner as on CUDA without flash-attn, with decode graphs; counts the decode steps the
    graphs run, by batch size."""
    use_cuda_kernels(monkeypatch)
    monkeypatch.setattr(ModelRunner, "_decode_graphs_usable", lambda runner: True)
    batches = []
    run = DecodeGraphs.run

    def counting_run(graphs, chunks, *args, **options):
        batches.append(len(chunks))
        return run(graphs, chunks, *args, **options)
    monkeypatch.setattr(DecodeGraphs, "run", counting_run)
    return batches


@pytest.mark.parametrize("model", MODELS)
def test_graph_buffers_give_transformers_tokens(tmp_path, smollm2_tokenizer, graphed, model):
    model_class, config_class, settings = MODELS[model]
    config = config_class(**settings, vocab_size=len(smollm2_tokenizer))
    llm, hf, _ = assert_matches_transformers(tmp_path, model_class, config, smollm2_tokenizer,
                                             num_prompts=3, new_tokens=6, max_num_seqs=4,
                                             num_scheduler_steps=CUDA_DECODE_RUN)
    runner = llm.engine.runner
    assert runner.kv_cache.layer(0).key.shape[0] == runner.num_blocks + 1  # the scratch block
    assert {1, 3} <= set(graphed)  # alone, and the three batched (bucket 4: one padding row)
    # Five prompts over four slots: batches shrink as sequences finish at different lengths.
    prompts = random_prompts(5, config.vocab_size, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True) for i in range(5)]
    graphed.clear()
    outputs = llm.generate(prompts, params)
    assert [out.token_ids for out in outputs] == [reference_greedy(hf, p, 2 + i)
                                                  for i, p in enumerate(prompts)]
    assert len(set(graphed)) >= 3 and max(graphed) <= 4


def test_only_decode_steps_that_fit_are_the_graphs():
    graphs = DecodeGraphs(None, num_kv_heads=2, block_size=8, max_model_len=64, buckets=batch_buckets(4),
                          scratch_block=10, windows=[], device=torch.device("cpu"))

    def chunk(tokens=1, blocks=2, encoder=None):
        return ScheduledChunk(0, [5] * tokens, 9, list(range(blocks)), None, 3, False,
                              encoder_token_ids=encoder)
    assert graphs.covers([chunk()] * 4)
    assert not graphs.covers([])
    assert not graphs.covers([chunk()] * 5)  # beyond the largest bucket
    assert not graphs.covers([chunk(), chunk(tokens=2)])  # a prompt chunk
    assert not graphs.covers([chunk(blocks=9)])  # beyond max_model_len's 8 blocks
    assert not graphs.covers([chunk(encoder=[1, 2])])
