"""Greedy tokens from tritonlm's LLM equal transformers' generate(do_sample=False) in fp32 for
SmolLM2 (the tiny random-weight Llama variants are in test_family_llama_variants.py)."""
from conftest import hf_greedy
from tritonlm import SamplingParams

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

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
