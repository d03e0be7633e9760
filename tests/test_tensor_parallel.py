"""Tensor parallelism: a checkpoint converted with --tp 2 and served by two ranks (real processes
over gloo) gives the same greedy tokens as one rank and as transformers; each rank's file holds
exactly its slice of the weights."""
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM,
                          GPTBigCodeConfig, GPTBigCodeForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MptConfig, MptForCausalLM, OPTConfig, OPTForCausalLM, T5Config,
                          T5ForConditionalGeneration)

from family_check import random_prompts, reference_greedy, save_tiny
from tritonlm import LLM, SamplingParams
from tritonlm.config import WEIGHTS_DIR
from tritonlm.layers.attention import PagedAttention
from tritonlm_convert.convert import convert
from tritonlm_convert.errors import ConversionError

NEW_TOKENS = 12
HEAD_DIM = 16  # 4 heads of a 64-wide model

# Each family as (model class, config) for a vocabulary size; 4 query heads everywhere.
FAMILIES = {
    "llama-gqa-4-heads-2-kv": lambda vocab: (LlamaForCausalLM, LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.15)),
    # One kv head for all queries: each rank keeps a copy of it.
    "falcon-7b-multi-query": lambda vocab: (FalconForCausalLM, FalconConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        initializer_range=0.15)),
    # Grouped kv heads in one fused projection: each rank keeps its own group.
    "falcon-40b-2-kv-groups": lambda vocab: (FalconForCausalLM, FalconConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        new_decoder_architecture=True, num_kv_heads=2, initializer_range=0.15)),
    "gpt-bigcode-multi-query": lambda vocab: (GPTBigCodeForCausalLM, GPTBigCodeConfig(
        vocab_size=vocab, n_embd=64, n_inner=128, n_layer=2, n_head=4, multi_query=True,
        initializer_range=0.15)),
    "opt-biased": lambda vocab: (OPTForCausalLM, OPTConfig(
        vocab_size=vocab, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, word_embed_proj_dim=64, init_std=0.15)),
    # ALiBi: each rank biases its heads with their own slopes.
    "bloom-alibi": lambda vocab: (BloomForCausalLM, BloomConfig(
        vocab_size=vocab, hidden_size=64, n_layer=2, n_head=4, initializer_range=0.15)),
    "mpt-alibi": lambda vocab: (MptForCausalLM, MptConfig(
        vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, max_seq_len=128,
        initializer_range=0.15)),
    # Relative position biases split by head, in the encoder and the decoder.
    "t5-gated-untied": lambda vocab: (T5ForConditionalGeneration, T5Config(
        vocab_size=vocab, d_model=64, d_kv=HEAD_DIM, d_ff=128, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1)),
}


@dataclass
class Converted:
    hf: torch.nn.Module
    hf_dir: Path
    repos: dict[int, Path]  # tensor-parallel size -> model directory

    def rank_tensors(self, rank: int) -> dict[str, torch.Tensor]:
        return load_file(self.repos[2] / "1" / WEIGHTS_DIR / f"rank{rank}.safetensors")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, smollm2_tokenizer):
    """family -> its tiny random checkpoint converted with tp 1 and tp 2 (built once)."""
    done = {}

    def get(family: str) -> Converted:
        if family not in done:
            model_class, config = FAMILIES[family](len(smollm2_tokenizer))
            root = tmp_path_factory.mktemp(family)
            hf = save_tiny(root / "hf", model_class, config, smollm2_tokenizer)
            repos = {tp: convert(str(root / "hf"), root / f"tp{tp}", dtype="float32", tp=tp)
                     for tp in (1, 2)}
            done[family] = Converted(hf, root / "hf", repos)
        return done[family]
    return get


def greedy(model_dir: Path, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy ids for the prompts in one batch, and how many query heads rank 0 computes."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), block_size=8) as llm:
        outputs = llm.generate(prompts, params)
        attention = next(m for m in llm.engine.runner.model.modules()
                         if isinstance(m, PagedAttention))
    return [out.token_ids for out in outputs], attention.num_heads


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_generate_what_one_rank_and_transformers_do(converted, family):
    model = converted(family)
    prompts = random_prompts(3, model.hf.config.vocab_size, max_len=24)
    expected = [reference_greedy(model.hf, p, NEW_TOKENS) for p in prompts]
    one_rank, heads_of_one = greedy(model.repos[1], prompts)
    two_ranks, heads_of_two = greedy(model.repos[2], prompts)
    assert (heads_of_one, heads_of_two) == (4, 2)
    assert one_rank == expected
    assert two_ranks == expected


def _rows(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return tensor[start:stop]


def _columns(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return tensor[:, start:stop]


def test_llama_rank_files_hold_their_slices(converted):
    """Rank r computes query heads 2r, 2r+1 and kv head r (4 heads, 2 kv heads, 2 ranks)."""
    model = converted("llama-gqa-4-heads-2-kv")
    full = load_file(model.hf_dir / "model.safetensors")
    half_inter = model.hf.config.intermediate_size // 2
    for rank in (0, 1):
        q_rows = (2 * rank * HEAD_DIM, (2 * rank + 2) * HEAD_DIM)
        kv_rows = (rank * HEAD_DIM, (rank + 1) * HEAD_DIM)
        inter = (rank * half_inter, (rank + 1) * half_inter)
        cut = {"q_proj": (_rows, q_rows), "k_proj": (_rows, kv_rows), "v_proj": (_rows, kv_rows),
               "o_proj": (_columns, q_rows), "gate_proj": (_rows, inter),
               "up_proj": (_rows, inter), "down_proj": (_columns, inter)}
        shard = model.rank_tensors(rank)
        assert shard.keys() == full.keys()
        for name, tensor in full.items():
            module = name.split(".")[-2]
            if module in cut:
                slicer, (start, stop) = cut[module]
                expected = slicer(tensor, start, stop)
            else:  # embeddings, norms and the head are replicated
                expected = tensor
            assert torch.equal(shard[name], expected), f"rank {rank}: {name}"


def test_multi_query_ranks_each_hold_the_one_kv_head(converted):
    """Falcon 7B's fused rows are [q0 q1 q2 q3 k v]: rank r keeps q2r, q2r+1, k and v."""
    model = converted("falcon-7b-multi-query")
    full = load_file(model.hf_dir / "model.safetensors")
    fused = [name for name in full if "query_key_value" in name]
    assert fused
    for rank in (0, 1):
        shard = model.rank_tensors(rank)
        for name in fused:
            heads = full[name].view(6, HEAD_DIM, -1)
            expected = torch.cat([heads[2 * rank:2 * rank + 2], heads[4:]]).flatten(0, 1)
            assert torch.equal(shard[name], expected), f"rank {rank}: {name}"


def test_heads_that_do_not_split_over_the_ranks_are_a_conversion_error(tmp_path, smollm2_tokenizer):
    config = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=48, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3)
    save_tiny(tmp_path / "hf", LlamaForCausalLM, config, smollm2_tokenizer)
    with pytest.raises(ConversionError, match="3 heads"):
        convert(str(tmp_path / "hf"), tmp_path / "repo", dtype="float32", tp=2)


def test_constrained_sampling_runs_on_rank_zero_alone(converted):
    """Structured output with two ranks: the driver holds the matchers and masks; the output
    full-matches the regex and equals one rank's (same seeds)."""
    model = converted("llama-gqa-4-heads-2-kv")
    pattern = r"[a-z]{2,6}( [a-z]{2,6}){2}"
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, guided_regex=pattern)
              for s in range(3)]
    texts = {}
    for tp in (1, 2):
        with LLM(str(model.repos[tp]), block_size=8) as llm:
            texts[tp] = [o.text for o in llm.generate(["Say three words:"] * 3, params)]
    assert all(re.fullmatch(pattern, t) for t in texts[2])
    assert texts[2] == texts[1]


def test_an_engine_dropped_without_shutdown_stops_its_ranks(converted, capfd):
    """`del llm` (no shutdown) of a two-rank engine: its worker exits cleanly, this process is
    single-rank again, and a one-rank engine of the same model loads and gives the same tokens."""
    import gc

    from tritonlm.distributed import parallel_state
    model = converted("llama-gqa-4-heads-2-kv")
    prompts = random_prompts(2, model.hf.config.vocab_size, max_len=16, seed=3)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(str(model.repos[2]), block_size=8)
    two_ranks = [o.token_ids for o in llm.generate(prompts, params)]
    workers = llm.engine.ranks.workers
    del llm
    gc.collect()
    assert [w.poll() for w in workers] == [0]
    assert parallel_state.current() == parallel_state.TensorParallel()
    with LLM(str(model.repos[1]), block_size=8) as one:
        assert [o.token_ids for o in one.generate(prompts, params)] == two_ranks
    assert "Traceback" not in capfd.readouterr().err


def test_speculation_over_two_ranks_keeps_transformers_tokens(converted):
    """n-gram speculation with two ranks: the driver proposes, every rank runs the verification
    rows (the plan it sends), greedy tokens stay transformers'."""
    from test_speculative import repeating_prompts
    model = converted("llama-gqa-4-heads-2-kv")
    prompts = repeating_prompts(3, seed=21)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(model.repos[2]), block_size=8, speculative="ngram") as llm:
        outputs = llm.generate(prompts, params)
        drafted = llm.engine.scheduler.num_draft_tokens
    assert [o.token_ids for o in outputs] == [reference_greedy(model.hf, p, NEW_TOKENS)
                                              for p in prompts]
    assert drafted > 0


def test_a_single_rank_draft_speculates_for_two_ranks(converted):
    """The one-rank conversion of the same model as the draft of its two-rank conversion: the
    draft runs whole beside the first rank, the ranks verify, greedy tokens stay transformers'
    and the draft's tokens (the same model's, summed in another order) are nearly all kept."""
    model = converted("llama-gqa-4-heads-2-kv")
    prompts = random_prompts(3, 2000, seed=23)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(model.repos[2]), block_size=8, speculative=str(model.repos[1])) as llm:
        outputs = llm.generate(prompts, params)
        scheduler = llm.engine.scheduler
        drafted, accepted = scheduler.num_draft_tokens, scheduler.num_accepted_tokens
    assert [o.token_ids for o in outputs] == [reference_greedy(model.hf, p, NEW_TOKENS)
                                              for p in prompts]
    assert drafted > 0 and accepted >= 0.9 * drafted


def test_a_draft_converted_for_two_ranks_is_refused(converted):
    model = converted("llama-gqa-4-heads-2-kv")
    with pytest.raises(ValueError, match="converted for 2 ranks"):
        LLM(str(model.repos[1]), block_size=8, speculative=str(model.repos[2]))
