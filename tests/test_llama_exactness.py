"""Greedy tokens from tritonlm's LLM equal transformers' generate(do_sample=False) in fp32."""
import pytest
import torch

from conftest import hf_greedy, make_tiny_llama, run_convert
from tritonlm import LLM, SamplingParams

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def random_prompts(n, vocab_size, max_len=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n,), generator=g).tolist()
    return [torch.randint(3, vocab_size, (k,), generator=g).tolist() for k in lengths]


TINY_VARIANTS = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    "multi-query": {"num_key_value_heads": 1},
    "no-gqa-head-dim-32": {"num_attention_heads": 2, "num_key_value_heads": 2},
    "rope-theta": {"rope_theta": 500000.0},
    "rope-linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "rope-llama3": {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}},
    "rope-yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 128}},
}


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_tiny_llama_matches_transformers(tmp_path, smollm2_tokenizer, variant):
    hf = make_tiny_llama(tmp_path / "hf", smollm2_tokenizer, **TINY_VARIANTS[variant])
    model_dir = run_convert(tmp_path / "hf", tmp_path / "repo", "--dtype", "float32")
    llm = LLM(str(model_dir), block_size=8)
    prompts = random_prompts(6, hf.config.vocab_size)
    outputs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
        assert out.finish_reason == "length"


CHAT_QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
                  "List three prime numbers."]


def test_smollm2_matches_transformers_gguf(smollm2_llm, smollm2_hf, smollm2_tokenizer):
    prompts = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                     add_generation_prompt=True, return_dict=False)
               for q in CHAT_QUESTIONS]
    prompts.append(smollm2_tokenizer.encode("The quick brown fox jumps over the lazy dog. 1234"))
    outputs = smollm2_llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(smollm2_hf, prompt, NEW_TOKENS)


def test_smollm2_text_prompt_tokenizes_like_transformers(smollm2_llm, smollm2_tokenizer):
    text = "Count: 1, 22, 333. Café ☕ 你好"
    out, = smollm2_llm.generate([text], SamplingParams(temperature=0, max_tokens=1))
    assert out.prompt_token_ids == smollm2_tokenizer.encode(text)
