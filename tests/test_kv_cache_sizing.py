"""Sizing the KV cache: the gpu_memory_utilization budget, the profile steps (the largest steps the
scheduler can plan) and running them through real models without disturbing the engine."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

from family_check import random_prompts, reference_greedy, save_tiny
from tritonlm import LLM, SamplingParams
from tritonlm.config import KV_CACHE_MEMORY_VARIABLE, EngineConfig
from tritonlm.engine.kv_cache_sizing import GIB, cuda_kv_cache_budget, profile_steps


def test_budget_is_the_fraction_less_peak_and_memory_outside_torch():
    # A 80 GiB GPU with 1 GiB taken by another process; the engine took 21 GiB: torch reserves
    # 20.5 of it (peak allocated 18), CUDA's context and cuBLAS the other 0.5.
    budget = cuda_kv_cache_budget(total=80 * GIB, free_at_start=79 * GIB, free_now=58 * GIB,
                                  reserved_now=int(20.5 * GIB), peak_reserved=18 * GIB,
                                  utilization=0.9)
    assert budget == int(0.9 * 80 * GIB) - 18 * GIB - GIB // 2


def test_budget_refuses_more_than_is_free_and_a_budget_of_nothing():
    with pytest.raises(ValueError, match="only 40.00 of 80.00 GiB were free"):
        cuda_kv_cache_budget(80 * GIB, 40 * GIB, 30 * GIB, 10 * GIB, 9 * GIB, 0.9)
    with pytest.raises(ValueError, match="leaves nothing for the KV cache"):
        cuda_kv_cache_budget(80 * GIB, 80 * GIB, 10 * GIB, 60 * GIB, 60 * GIB, 0.5)


@pytest.mark.parametrize("utilization", [0, 1.5, -0.1])
def test_utilization_outside_zero_one_is_rejected(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=utilization)


@pytest.mark.parametrize("batched,model_len,seqs", [(2048, 2048, 256), (2048, 512, 3), (100, 64, 8)])
def test_profile_steps_are_the_largest_the_scheduler_can_plan(batched, model_len, seqs):
    (prefill, decode), num_blocks = profile_steps(batched, model_len, seqs, block_size=16)
    lengths = [len(c.token_ids) for c in prefill.chunks]
    assert sum(lengths) == min(batched, model_len * seqs) and max(lengths) <= model_len
    assert len(decode.chunks) == min(seqs, batched)
    assert all(len(c.token_ids) == 1 and c.start_pos == len(c.history) for c in decode.chunks)
    tables = [b for plan in (prefill, decode) for c in plan.chunks for b in c.block_table]
    assert sorted(tables) == list(range(num_blocks))  # disjoint, and all of the cache
    assert all(c.sampling.params.logprobs and c.track_tokens
               for plan in (prefill, decode) for c in plan.chunks)


def _tiny_llama(tokenizer):
    return LlamaForCausalLM, LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _tiny_t5(tokenizer):
    return T5ForConditionalGeneration, T5Config(
        vocab_size=len(tokenizer), d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0)


@pytest.mark.parametrize("family", [_tiny_llama, _tiny_t5])
def test_profile_steps_run_through_the_model_and_leave_the_engine_as_it_was(
        tmp_path, smollm2_tokenizer, family):
    from tritonlm_convert.convert import convert
    model_class, config = family(smollm2_tokenizer)
    hf = save_tiny(tmp_path / "hf", model_class, config, smollm2_tokenizer)
    model_dir = convert(str(tmp_path / "hf"), tmp_path / "repo", dtype="float32")
    llm = LLM(str(model_dir), block_size=8, num_kv_blocks=64, max_model_len=64,
              max_num_batched_tokens=96, max_num_seqs=8)
    prompts = random_prompts(3, config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = [out.token_ids for out in llm.generate(prompts, params)]
    runner = llm.engine.runner
    cache = runner.kv_cache
    assert runner.run_profile_steps() == profile_steps(96, 64, 8, 8, runner.encoder_decoder)[1]
    assert runner.kv_cache is cache and not runner.token_counts.rows
    after = [out.token_ids for out in llm.generate(prompts, params)]
    assert before == after == [reference_greedy(hf, p, 8) for p in prompts]


@pytest.mark.parametrize("family, speculative, blocks_per_seq", [
    (_tiny_llama, None, 4),  # 64 tokens in blocks of 16
    (_tiny_llama, "ngram", 5),  # and a verification step's 8 lookahead slots (ngram's K)
    (_tiny_t5, None, 8)])  # and as many again for the encoder's K/V
def test_a_cache_the_memory_would_oversize_holds_what_its_sequences_can_use(
        tmp_path, smollm2_tokenizer, family, speculative, blocks_per_seq, monkeypatch):
    """kv_cache_memory's 1 GiB default would hold ~130,000 of these tiny models' blocks: the
    cache gets what max_num_seqs sequences of max_model_len tokens hold at once, and they all
    run to that length together without a preemption."""
    monkeypatch.delenv(KV_CACHE_MEMORY_VARIABLE, raising=False)  # conftest's, for the others
    from tritonlm_convert.convert import convert
    model_class, config = family(smollm2_tokenizer)
    save_tiny(tmp_path / "hf", model_class, config, smollm2_tokenizer)
    model_dir = convert(str(tmp_path / "hf"), tmp_path / "repo", dtype="float32")
    llm = LLM(str(model_dir), max_model_len=64, max_num_seqs=3, speculative=speculative)
    assert llm.engine.config.kv_cache_memory == 1 << 30
    assert llm.engine.runner.num_blocks == 3 * blocks_per_seq
    prompts = torch.randint(3, config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outputs = llm.generate(prompts.tolist(), params)
    assert [len(out.token_ids) for out in outputs] == [48] * 3
    assert llm.engine.scheduler.num_preemptions == 0
