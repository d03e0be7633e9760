"""The model-family check: a tiny random-weight transformers model, saved and converted, must give
the same greedy tokens from tritonlm's LLM as transformers' generate, alone and batched."""
from pathlib import Path

import torch

from tritonlm import LLM, SamplingParams

NEW_TOKENS = 24


def random_prompts(n: int, vocab_size: int, max_len: int = 40, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n,), generator=g).tolist()
    return [torch.randint(3, vocab_size, (k,), generator=g).tolist() for k in lengths]


def byte_tokenizer():
    """Byte-level BPE over the 256 byte symbols (ids 0-255), no merges, BOS (256) prepended,
    EOS 257: a whole vocabulary a tiny model's distribution can be tested over."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   add_bos_token=True, chat_template=template)


def save_tiny(directory: Path, model_class, config, tokenizer):
    """A random-weight model of `model_class(config)` saved as safetensors with `tokenizer`."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return model


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, EOS ignored; decoder-only or encoder-decoder."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
    generated = out[0, 1:] if model.config.is_encoder_decoder else out[0, len(prompt_ids):]
    return generated.tolist()


TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.15)


def tiny_llama(directory: Path, tokenizer, **config):
    """A tiny random Llama (TINY_LLAMA, `config` over it) with `tokenizer`'s vocabulary, saved
    under directory/hf and converted (float32) into directory/repo: (the model, its model dir)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from tritonlm_convert.convert import convert
    hf_config = LlamaConfig(**{**TINY_LLAMA, **config}, vocab_size=len(tokenizer))
    hf = save_tiny(directory / "hf", LlamaForCausalLM, hf_config, tokenizer)
    return hf, convert(str(directory / "hf"), directory / "repo", dtype="float32")


def assert_matches_transformers(tmp_path: Path, model_class, config, tokenizer, num_prompts=4,
                                new_tokens=NEW_TOKENS, prompts=None, **engine_overrides):
    """Convert a tiny `model_class(config)` and compare greedy ids one at a time and batched."""
    from tritonlm_convert.convert import convert
    hf = save_tiny(tmp_path / "hf", model_class, config, tokenizer)
    model_dir = convert(str(tmp_path / "hf"), tmp_path / "repo", dtype="float32")
    llm = LLM(str(model_dir), **{"block_size": 8, **engine_overrides})
    prompts = prompts or random_prompts(num_prompts, config.vocab_size)
    expected = [reference_greedy(hf, p, new_tokens) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    batched = [out.token_ids for out in llm.generate(prompts, params)]
    for i, want in enumerate(expected):
        assert alone[i] == want, f"prompt {i} alone diverges at {_first_difference(alone[i], want)}"
        assert batched[i] == want, f"prompt {i} batched diverges at {_first_difference(batched[i], want)}"
    return llm, hf, prompts


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
