"""On a CUDA GPU (skipped elsewhere; tools/gpu_check.sh runs them with the other CUDA-capable
tests): every family's bfloat16 greedy tokens against transformers' on the same GPU, CUDA graphs
against eager steps, the fused quantized matmul inside a model, and gpu_memory_utilization
against the memory the driver reports in use. (The families in float32 on CUDA: the
test_family_* modules, which run on the GPU where there is one.)"""
import logging

import pytest
import torch
from transformers import (BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM,
                          GemmaConfig, GemmaForCausalLM, GPTBigCodeConfig, GPTBigCodeForCausalLM,
                          GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, MptConfig, MptForCausalLM, OPTConfig,
                          OPTForCausalLM, Qwen2Config, Qwen2ForCausalLM, T5Config,
                          T5ForConditionalGeneration)

from family_check import random_prompts, save_tiny
from tritonlm import LLM, SamplingParams
from tritonlm.engine.decode_graphs import DecodeGraphs
from tritonlm.layers import quantized_matmul

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15)
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig, DECODER),
    "mistral-window-7": (MistralForCausalLM, MistralConfig, {**DECODER, "sliding_window": 7}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, DECODER),
    "gemma": (GemmaForCausalLM, GemmaConfig, {**DECODER, "head_dim": 32}),
    "bloom": (BloomForCausalLM, BloomConfig,
              dict(hidden_size=64, n_layer=2, n_head=4, initializer_range=0.15)),
    "falcon": (FalconForCausalLM, FalconConfig,
               dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    initializer_range=0.15)),
    "gpt-neox": (GPTNeoXForCausalLM, GPTNeoXConfig,
                 {**DECODER, "num_key_value_heads": None, "rotary_pct": 0.25}),
    "opt": (OPTForCausalLM, OPTConfig,
            dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=256, init_std=0.15)),
    "gpt-bigcode": (GPTBigCodeForCausalLM, GPTBigCodeConfig,
                    dict(n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=256,
                         initializer_range=0.15, multi_query=True)),
    "mpt": (MptForCausalLM, MptConfig,
            dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=256, initializer_range=0.15)),
    "t5": (T5ForConditionalGeneration, T5Config,
           dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0,
                pad_token_id=0, eos_token_id=1, feed_forward_proj="gated-gelu",
                tie_word_embeddings=False)),
}
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# bfloat16 keeps 8 bits: where two logits lie closer than this share of the largest, the two
# implementations' roundings may pick either.
NEAR_TIE = 0.02


def convert_tiny(tmp_path, family, tokenizer, dtype, **convert_args):
    from tritonlm_convert.convert import convert
    model_class, config_class, settings = FAMILIES[family]
    config = config_class(**{k: v for k, v in settings.items() if v is not None},
                          vocab_size=len(tokenizer))
    hf = save_tiny(tmp_path / "hf", model_class, config, tokenizer)
    return hf, convert(str(tmp_path / "hf"), tmp_path / "repo", dtype=dtype, **convert_args)


def next_token_logits(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits for the token after `prompt` + `generated`, on the model's device."""
    device = hf.device
    with torch.inference_mode():
        if hf.config.is_encoder_decoder:
            decoder = torch.tensor([[hf.config.decoder_start_token_id, *generated]], device=device)
            out = hf(input_ids=torch.tensor([prompt], device=device), decoder_input_ids=decoder)
        else:
            out = hf(input_ids=torch.tensor([prompt + generated], device=device))
    return out.logits[0, -1].float()


def reference_greedy(hf, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device=hf.device)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                          pad_token_id=0)
    return (out[0, 1:] if hf.config.is_encoder_decoder else out[0, len(prompt):]).tolist()


def assert_same_or_near_tie(hf, prompt, ours: list[int], theirs: list[int]) -> None:
    """Equal up to the first difference; there, our token's logit (transformers', after the
    common prefix) is within NEAR_TIE of the best one. Past it the two continue different texts."""
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if i is None:
        assert len(ours) == len(theirs)
        return
    logits = next_token_logits(hf, prompt, theirs[:i])
    gap = (logits.max() - logits[ours[i]]).item()
    assert gap <= NEAR_TIE * logits.abs().max().item(), (
        f"token {i}: ours {ours[i]} is {gap:.4f} below transformers' {theirs[i]} "
        f"(largest logit {logits.abs().max().item():.3f})")


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_greedy_matches_transformers_on_the_gpu(tmp_path, smollm2_tokenizer, family):
    hf, repo = convert_tiny(tmp_path, family, smollm2_tokenizer, "bfloat16")
    hf = hf.to("cuda", torch.bfloat16)
    llm = LLM(str(repo), block_size=8, max_num_seqs=8)
    assert llm.engine.runner.device.type == "cuda" and llm.engine.runner.dtype == torch.bfloat16
    prompts = random_prompts(5, hf.config.vocab_size, seed=1)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    batched = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    for prompt, one, many in zip(prompts, alone, batched):
        theirs = reference_greedy(hf, prompt)
        assert_same_or_near_tie(hf, prompt, one, theirs)
        assert_same_or_near_tie(hf, prompt, many, theirs)


@pytest.fixture
def replays(monkeypatch):
    """The batch sizes of the decode steps that replayed a captured graph."""
    sizes = []
    run = DecodeGraphs.run

    def counting(graphs, chunks, *args, **options):
        if (graphs.bucket(len(chunks)), False) in graphs.graphs:
            sizes.append(len(chunks))
        return run(graphs, chunks, *args, **options)
    monkeypatch.setattr(DecodeGraphs, "run", counting)
    return sizes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "mistral-window-7", "bloom"])
def test_cuda_graphs_give_the_eager_tokens(tmp_path, smollm2_tokenizer, replays, family, dtype):
    """Mixed prompt lengths and output lengths, so that decode batches shrink through several
    buckets (padded rows included) while others still prefill."""
    _, repo = convert_tiny(tmp_path, family, smollm2_tokenizer, dtype)
    prompts = random_prompts(11, len(smollm2_tokenizer), seed=2)
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]
    eager = LLM(str(repo), block_size=8, max_num_seqs=16, enforce_eager=True)
    assert eager.engine.runner.decode_graphs is None
    expected = [out.token_ids for out in eager.generate(prompts, params)]
    del eager
    graphed = LLM(str(repo), block_size=8, max_num_seqs=16)
    graphs = graphed.engine.runner.decode_graphs
    assert sorted(bucket for bucket, _ in graphs.graphs) == [1, 2, 4, 8, 16]
    assert [out.token_ids for out in graphed.generate(prompts, params)] == expected
    assert len(set(replays)) >= 4, replays  # several buckets replayed, most with padding


def test_decode_runs_on_cuda_graphs_sample_as_single_steps(tmp_path, smollm2_tokenizer):
    """Runs of up to 8 steps (the CUDA default) replaying the graphs, their input ids copied on
    the device: the same sampled tokens and logprobs as one step per schedule."""
    _, repo = convert_tiny(tmp_path, "llama", smollm2_tokenizer, "bfloat16")
    prompts = random_prompts(6, len(smollm2_tokenizer), seed=4)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=20 + 3 * i,
                             logprobs=2, ignore_eos=True) for i in range(len(prompts))]
    single = LLM(str(repo), block_size=8, max_num_seqs=8, num_scheduler_steps=1)
    expected = single.generate(prompts, params)
    del single
    runs = LLM(str(repo), block_size=8, max_num_seqs=8)
    assert runs.engine.runner.max_decode_run == 8
    got = runs.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got, expected):
        assert [e["logprob"] for e in a.logprobs] == pytest.approx(
            [e["logprob"] for e in b.logprobs], abs=1e-5)


@pytest.mark.parametrize("quantize,group_size", [("int4", 32), ("int8", None)])
def test_fused_quantized_matmul_gives_the_dequantized_tokens(tmp_path, smollm2_tokenizer,
                                                             monkeypatch, quantize, group_size):
    """A quantized model through the Triton kernel on the GPU, against the same weights
    dequantized and multiplied by torch (float32: the same products, other summation order)."""
    _, repo = convert_tiny(tmp_path, "llama", smollm2_tokenizer, "float32",
                           quantize=quantize, group_size=group_size)
    prompts = random_prompts(6, len(smollm2_tokenizer), seed=3)

    def run() -> tuple[list[list[int]], list]:
        llm = LLM(str(repo), block_size=8)
        tokens = [out.token_ids for out in llm.generate(prompts, GREEDY)]
        return tokens, [m.fused for m in llm.engine.runner.model.modules() if hasattr(m, "fused")]
    fused_tokens, fused = run()
    assert fused and all(callable(f) for f in fused)
    monkeypatch.setattr(quantized_matmul, "cuda_matmul", lambda *args: None)
    plain_tokens, plain = run()
    assert plain and all(f is None for f in plain)
    assert plain_tokens == fused_tokens


def device_memory_used() -> int:
    """Bytes in use on GPU 0 as the driver reports them (nvidia-smi's figure), every process."""
    import pynvml
    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used
    finally:
        pynvml.nvmlShutdown()


def test_gpu_memory_utilization_bounds_what_the_process_uses(tmp_path, smollm2_tokenizer, caplog):
    """The engine sizes its KV cache so that everything it holds (weights, cache, the largest
    step's activations, CUDA graphs, CUDA's own context) stays within the fraction, measured by
    the driver while the largest batch runs at the longest context. Run alone on its GPU."""
    caplog.set_level(logging.INFO, logger="tritonlm.engine")  # the sizing, shown on failure
    utilization = 0.25
    _, repo = convert_tiny(tmp_path, "llama", smollm2_tokenizer, "bfloat16")
    total = torch.cuda.mem_get_info()[1]
    before = device_memory_used()
    llm = LLM(str(repo), gpu_memory_utilization=utilization, max_num_seqs=64,
              max_model_len=512, max_num_batched_tokens=2048)
    peak = 0

    def sample_memory(*_):
        nonlocal peak
        peak = max(peak, device_memory_used() - before)
    prompts = random_prompts(64, len(smollm2_tokenizer), max_len=400, seed=4)
    step = llm.engine.step

    def measured_step():
        out = step()
        sample_memory()
        return out
    llm.engine.step = measured_step
    llm.generate(prompts, SamplingParams(temperature=0.8, top_k=50, max_tokens=100,
                                         ignore_eos=True, logprobs=5))
    runner = llm.engine.runner
    cache_bytes = runner.num_blocks * runner.cache_slots.bytes_per_block()
    assert cache_bytes > 0.5 * utilization * total  # a tiny model: the cache takes most of it
    assert peak <= utilization * total, (
        f"{peak / 2**30:.2f} GiB in use > {utilization} of {total / 2**30:.2f} GiB")
