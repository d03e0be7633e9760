"""Multi-LoRA: each adapter's greedy tokens equal the peft library's merged model in
transformers; a batch mixing adapters and the base model equals each request alone; adapters
beyond max_loras wait; bad adapters and names are clear errors."""
import copy
import json
import subprocess
import sys

import pytest
import torch
from transformers import GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

from family_check import TINY_LLAMA, random_prompts, save_tiny
from lora_check import FAMILIES, NEW_TOKENS, build, merged_greedy, register, save_adapter
from tritonlm import LLM, SamplingParams
from tritonlm.errors import InvalidRequestError

def greedy(lora_name=None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                          lora_name=lora_name)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_adapter_equals_peft_merged_and_a_mixed_batch_equals_each_alone(
        tmp_path, smollm2_tokenizer, family):
    model_dir, prompts, references = build(tmp_path, smollm2_tokenizer, family)
    assert references["all"] != references[None] != references["some"]
    with LLM(str(model_dir), block_size=8) as llm:
        for name, expected in references.items():
            alone = [llm.generate(p, greedy(name))[0].token_ids for p in prompts]
            assert alone == expected, name
        # every prompt under every adapter and the base in one batch (prefix caching on: the
        # same prompt's blocks differ by adapter)
        names = list(references)
        mixed = llm.generate([p for p in prompts for _ in names],
                             [greedy(n) for _ in prompts for n in names])
        assert [o.token_ids for o in mixed] == [references[n][i] for i in range(len(prompts))
                                                for n in names]


def test_adapters_beyond_max_loras_wait_and_finish_the_same(tmp_path, smollm2_tokenizer):
    model_dir, prompts, references = build(tmp_path, smollm2_tokenizer, "llama")
    with LLM(str(model_dir), block_size=8, max_loras=1) as llm:
        names = ["all", "some", None, "all"]
        outputs = llm.generate([prompts[0]] * len(names), [greedy(n) for n in names])
        assert [o.token_ids for o in outputs] == [references[n][0] for n in names]
        with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'.*all, some"):
            llm.generate(prompts[0], greedy("nope"))


def test_speculative_decoding_under_adapters_equals_peft_merged(tmp_path, smollm2_tokenizer):
    """n-gram drafts verified by the model with each request's adapter: the tokens stay peft's."""
    prompts = [p * 3 for p in random_prompts(3, len(smollm2_tokenizer), max_len=10, seed=5)]
    model_dir, prompts, references = build(tmp_path, smollm2_tokenizer, "llama", prompts)
    with LLM(str(model_dir), block_size=8, speculative="ngram", num_speculative_tokens=4,
             prompt_lookup_min=1, prompt_lookup_max=3, speculative_disable_by_batch_size=64) as llm:
        adapted = llm.generate(prompts, [greedy("all")] * len(prompts))
        assert [o.token_ids for o in adapted] == references["all"]
        assert llm.engine.scheduler.num_accepted_tokens > 0  # drafts kept under the adapter
        names = list(references)
        outputs = llm.generate([p for p in prompts for _ in names], [greedy(n) for _ in prompts for n in names])
        assert [o.token_ids for o in outputs] == [references[n][i] for i in range(len(prompts)) for n in names]


def test_bad_adapters_are_refused_at_load_naming_why(tmp_path, smollm2_tokenizer):
    from tritonlm_convert.convert import convert
    base = tmp_path / "hf"
    save_tiny(base, LlamaForCausalLM, LlamaConfig(**TINY_LLAMA, vocab_size=len(smollm2_tokenizer)),
              smollm2_tokenizer)
    model_dir = convert(str(base), tmp_path / "repo", dtype="float32")
    rank8 = save_adapter(LlamaForCausalLM.from_pretrained(base), tmp_path / "rank8", 1, r=8,
                         lora_alpha=8, target_modules=["q_proj"])
    register(model_dir, {"rank8": rank8})
    with pytest.raises(ValueError, match=r"rank 8, over max_lora_rank \(4\)"):
        LLM(str(model_dir), max_lora_rank=4)
    version = model_dir / "1"
    for where in ("../../outside", str(tmp_path / "rank8")):  # a repository reads only itself
        (version / "multi_lora.json").write_text(json.dumps({"escape": where}))
        with pytest.raises(ValueError, match="'escape'.*outside the model version directory"):
            LLM(str(model_dir))
    vocab = len(smollm2_tokenizer)
    others = {  # adapters of other base models: a wider Llama, another family
        "wide": (LlamaForCausalLM, LlamaConfig(**{**TINY_LLAMA, "hidden_size": 32},
                                               vocab_size=vocab), "q_proj",
                 "'wide'.*takes 64 inputs.*another base model"),
        "neox": (GPTNeoXForCausalLM, FAMILIES["gpt_neox"][1](vocab), "dense",
                 "'neox' targets gpt_neox.layers.0.attention.dense"),
    }
    for name, (model_class, config, module, error) in others.items():
        save_tiny(tmp_path / f"{name}-base", model_class, config, smollm2_tokenizer)
        register(model_dir, {name: save_adapter(
            model_class.from_pretrained(tmp_path / f"{name}-base"), tmp_path / name, 1, r=4,
            lora_alpha=8, target_modules=[module])})
        with pytest.raises(ValueError, match=error):
            LLM(str(model_dir))


def test_converter_registers_adapters_and_adds_more_to_a_converted_model(tmp_path,
                                                                          smollm2_tokenizer):
    from conftest import run_convert
    base = tmp_path / "hf"
    save_tiny(base, LlamaForCausalLM, LlamaConfig(**TINY_LLAMA, vocab_size=len(smollm2_tokenizer)),
              smollm2_tokenizer)
    first = save_adapter(LlamaForCausalLM.from_pretrained(base), tmp_path / "first", 1, r=8,
                         lora_alpha=16, target_modules=["q_proj", "down_proj"])
    second = save_adapter(LlamaForCausalLM.from_pretrained(base), tmp_path / "second", 2, r=4,
                          lora_alpha=4, target_modules=["v_proj"])
    model_dir = run_convert(base, tmp_path / "repo", "--dtype", "float32", "--lora",
                            f"first={first}", "--max-loras", "2")
    converter = [sys.executable, "-m", "tritonlm_convert"]
    added = subprocess.run([*converter, "--add-lora", str(model_dir), f"second={second}"],
                           capture_output=True, text=True)
    assert added.returncode == 0, added.stderr
    refused = subprocess.run([*converter, "--add-lora", str(model_dir), f"bad={tmp_path}"],
                             capture_output=True, text=True)
    assert refused.returncode == 1 and "lacks adapter_config.json" in refused.stderr
    prompt = random_prompts(1, len(smollm2_tokenizer), seed=5)[0]
    with LLM(str(model_dir)) as llm:
        assert llm.engine.config.max_loras == 2
        for name, adapter in (("first", first), ("second", second)):
            expected = merged_greedy(LlamaForCausalLM.from_pretrained(base), adapter, [prompt],
                                     NEW_TOKENS)
            assert llm.generate(prompt, greedy(name))[0].token_ids == expected[0]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_two_tensor_parallel_ranks_equal_one(tmp_path, smollm2_tokenizer, family):
    """Adapters sharded like their layers (A by input for row-parallel layers, B by output
    for column-parallel ones) over two ranks give the single rank's (and peft's) tokens."""
    from tritonlm_convert.convert import convert
    model_dir, prompts, references = build(tmp_path, smollm2_tokenizer, family)
    version = next(p for p in model_dir.iterdir() if p.name.isdigit())
    adapters = [(name, tmp_path / name) for name in ("all", "some")]
    tp2 = convert(str(tmp_path / "hf"), tmp_path / "tp2", dtype="float32", tp=2, loras=adapters)
    assert (tp2 / "1" / "multi_lora.json").is_file() and (version / "multi_lora.json").is_file()
    names = list(references)
    with LLM(str(tp2), block_size=8) as llm:
        outputs = llm.generate([p for p in prompts for _ in names],
                               [greedy(n) for _ in prompts for n in names])
    assert [o.token_ids for o in outputs] == [references[n][i] for i in range(len(prompts))
                                              for n in names]


def test_smollm2_with_a_random_adapter_equals_peft_merged(smollm2_repo, smollm2_hf, tmp_path,
                                                           smollm2_tokenizer):
    """A rank-16 adapter on every linear layer of SmolLM2 (the float32 conversion of the GGUF)
    equals peft's merged model in transformers (loaded from the same GGUF)."""
    from conftest import linked_repository

    def smollm2():  # peft changes the model it wraps: a copy of the session's
        return copy.deepcopy(smollm2_hf)
    # PEFT's random B as it is: the text changes but stays text (scaled up, gibberish's logits
    # are near-ties)
    adapter = save_adapter(smollm2(), tmp_path / "tuned", 7, b_scale=1, r=16, lora_alpha=32,
                           target_modules=FAMILIES["llama"][2])
    prompts = [smollm2_tokenizer.encode(p) for p in ("The capital of France is",
                                                      "def fibonacci(n):")]
    expected = merged_greedy(smollm2(), adapter, prompts, NEW_TOKENS)
    model_dir = linked_repository(smollm2_repo, tmp_path / "repo") / "llm"
    register(model_dir, {"tuned": adapter})
    with LLM(str(model_dir)) as llm:
        assert [llm.generate(p, greedy("tuned"))[0].token_ids for p in prompts] == expected
        assert llm.generate(prompts[0], greedy())[0].token_ids != expected[0]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_adapters_over_quantized_weights_equal_peft_over_the_dequantized_model(
        tmp_path, smollm2_tokenizer, method):
    from test_gguf_keep_quantized import rank_file
    from test_quantize import GROUPING, _reference_with, dequantized_weights
    from tritonlm_convert.convert import convert
    base = tmp_path / "hf"
    save_tiny(base, LlamaForCausalLM, LlamaConfig(**TINY_LLAMA, vocab_size=len(smollm2_tokenizer)),
              smollm2_tokenizer)
    adapter = save_adapter(LlamaForCausalLM.from_pretrained(base), tmp_path / "all", 1, r=8,
                           lora_alpha=16, target_modules=FAMILIES["llama"][2])
    model_dir = convert(str(base), tmp_path / "repo", dtype="float32", quantize=method,
                        loras=[("all", adapter)], **GROUPING[method])
    reference = _reference_with(base, dequantized_weights(rank_file(model_dir)))
    prompts = random_prompts(3, len(smollm2_tokenizer), seed=4)
    expected = merged_greedy(reference, adapter, prompts, NEW_TOKENS)
    with LLM(str(model_dir), block_size=8, quantized_activations="float") as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy("all"))] == expected
