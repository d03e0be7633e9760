"""Perplexity as the engine computes it (its model and paged cache) equals transformers' own."""
import math
from pathlib import Path

import torch

from tritonlm.engine.llm_engine import LLMEngine
from tritonlm.quality import perplexity, report

# Botchan's opening (public domain), about 1,000 tokens
TEXT = "\n".join((Path(__file__).parent / "data" / "botchan_chapters_1_2.txt").read_text()
                 .splitlines()[:60])
WINDOW = 256


def hf_perplexity(model, token_ids: list[int], window: int) -> float:
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(token_ids) - 1, window):
            ids = torch.tensor([token_ids[start:start + window + 1]])
            out = model(ids, labels=ids)
            total += out.loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return math.exp(total / count)


def test_smollm2_perplexity_equals_transformers(smollm2_repo, smollm2_hf):
    engine = LLMEngine(smollm2_repo, num_kv_blocks=64)
    token_ids = engine.tokenizer.encode(TEXT)
    ours = perplexity(engine, token_ids, WINDOW)
    assert len(token_ids) > 3 * WINDOW
    assert math.isclose(ours, hf_perplexity(smollm2_hf, token_ids, WINDOW), rel_tol=1e-4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_report_gives_transformers_greedy_continuations(smollm2_repo, smollm2_hf, smollm2_tokenizer):
    from conftest import hf_greedy
    prompts = ["The capital of France is", "def fibonacci(n):"]
    result = report(smollm2_repo, TEXT, WINDOW, prompts, max_tokens=12, num_kv_blocks=64)
    for prompt in prompts:
        ids = smollm2_tokenizer(prompt)["input_ids"]
        continuation = hf_greedy(smollm2_hf, ids, 12)
        eos = smollm2_tokenizer.eos_token_id
        continuation = continuation[:continuation.index(eos)] if eos in continuation else continuation
        expected = smollm2_tokenizer.decode(continuation, skip_special_tokens=True)
        assert result["greedy"][prompt] == expected
    assert result["tokens"] > 3 * WINDOW and result["perplexity"] > 1
    assert result["weight_bytes"] > 0 and result["kv_blocks"] == 64


def _perplexity(model_dir, **overrides) -> float:
    engine = LLMEngine(model_dir, num_kv_blocks=64, **overrides)
    return perplexity(engine, engine.tokenizer.encode(TEXT), WINDOW)


def test_int8_weights_and_int8_kv_cache_stay_within_one_percent(smollm2_repo, tmp_path):
    from conftest import run_convert
    int8 = run_convert("default", tmp_path / "int8", "--dtype", "bfloat16", "--quantize", "int8")
    reference = _perplexity(smollm2_repo, dtype="bfloat16")  # the float32 weights cast on load
    assert abs(_perplexity(int8) / reference - 1) < 0.01
    assert abs(_perplexity(smollm2_repo, dtype="bfloat16", kv_cache_dtype="int8") / reference
               - 1) < 0.01


def test_compare_converts_and_scores_each_method(tmp_path, smollm2_tokenizer):
    """`quality --compare` on a tiny Llama: each variant converted by tritonlm-convert, the float
    one matching itself, the others smaller (int4 body, int8 head; the float embedding stays)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from family_check import save_tiny
    from tritonlm.quality_compare import compare, table
    config = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=False)
    save_tiny(tmp_path / "hf", LlamaForCausalLM, config, smollm2_tokenizer)
    calibration = tmp_path / "calibration.txt"
    calibration.write_text(TEXT[:3000])
    rows = compare(str(tmp_path / "hf"), [32], calibration, 2, TEXT, tmp_path / "work", WINDOW)
    by_name = {row["variant"]: row for row in rows}
    assert list(by_name) == ["float", "rtn g32", "gptq g32", "awq g32"]
    assert by_name["float"]["greedy_match"] == 1.0
    assert all(0 <= row["greedy_match"] <= 1 and row["perplexity"] > 1 for row in rows)
    body = by_name["float"]["weight_bytes"]
    assert all(by_name[name]["weight_bytes"] < 0.7 * body for name in ("rtn g32", "gptq g32", "awq g32"))
    assert "| awq g32 |" in table(rows)
