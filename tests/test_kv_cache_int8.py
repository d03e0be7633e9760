"""int8 KV cache (kv_cache_dtype="int8"): K/V stored as int8 with a float16 scale per (token, kv
head), rotated by a Hadamard matrix. About twice the blocks of a 16-bit cache (four times float32's)
for the same memory; greedy tokens and logprobs close to a float32 cache's; batching, preemption,
prefix caching, copy on write, T5's cross-attention and tensor parallelism keep working."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

from family_check import random_prompts, save_tiny
from tritonlm import LLM, SamplingParams
from tritonlm.engine.llm_engine import _SEED_STRIDE
from tritonlm.layers import attention
from tritonlm.layers.kv_cache import KVCache, dequantize, hadamard, quantize
from tritonlm_convert.convert import convert

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
TEXTS = ["The capital of France is", "Once upon a time, in a small village,",
         "The three primary colours are", "def fibonacci(n):"]
QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn.", "Who wrote Hamlet?",
             "Why is the sky blue?"]


def test_round_trip_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, 64, generator=g) * torch.logspace(-6, 4, 32)[:, None, None]
    x[0, 0] = 0  # an all-zero row
    x[1, :, 7] = 1000  # an outlier feature
    values, scales = quantize(x)
    assert values.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (32, 4)
    error = (dequantize(values, scales, torch.float32) - x).abs()
    step = scales.float().unsqueeze(-1)
    assert (error <= step / 2 + 1e-6 * x.abs()).all()
    assert (x.abs().amax(-1) / step.squeeze(-1) <= 127.5).all()  # the range is used, not wasted


@pytest.mark.parametrize("dim", [16, 64, 80, 128])
def test_hadamard_rotation_is_orthonormal(dim):
    h = hadamard(dim)
    assert torch.allclose(h @ h.mT, torch.eye(dim), atol=1e-6)


def test_a_larger_token_in_a_partly_filled_block_leaves_the_earlier_ones_exact():
    """Each token has its own scale: writing a token 1000x larger into the block changes nothing
    the block already holds."""
    cache = KVCache(1, 2, (1, 4, 16), torch.float32, True, torch.device("cpu"))
    layer = cache.layer(0)
    small = torch.randn(2, 1, 16) * 1e-2
    layer.write(small, small, torch.tensor([4, 5]), 16)  # block 1, offsets 0 and 1
    before = layer.gather(torch.tensor([[[1]]]), torch.float32)
    layer.write(small[:1] * 1000, small[:1] * 1000, torch.tensor([6]), 16)
    after = layer.gather(torch.tensor([[[1]]]), torch.float32)
    for b, a in zip(before, after):
        assert torch.equal(b[..., :2, :], a[..., :2, :])
    # Within half a step per rotated feature, so within sqrt(D) / 2 steps in norm.
    error = (layer.unrotate(after[0][0, 0, :3]) - torch.cat([small, small[:1] * 1000])[:, 0])
    steps = layer.key_scales[1, 0, :3].float()
    assert (error.norm(dim=-1) <= 16 ** 0.5 / 2 * steps).all()


def test_block_copies_carry_the_scales():
    cache = KVCache(2, 4, (2, 4, 8), torch.float32, True, torch.device("cpu"))
    for slot in range(2):
        x = torch.randn(8, 2, 8)
        cache.layer(slot).write(x, -x, torch.arange(16), 8)  # blocks 0 and 1
    cache.copy_blocks(torch.tensor([0, 1]), torch.tensor([3, 2]))
    for slot in range(2):
        layer = cache.layer(slot)
        copied = layer.gather(torch.tensor([[[6, 7], [4, 5]]]), torch.float32)
        original = layer.gather(torch.tensor([[[0, 1], [2, 3]]]), torch.float32)
        assert all(torch.equal(c, o) for c, o in zip(copied, original))


def test_flash_attention_is_not_used_with_an_int8_cache(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_varlen_func", object())
    cuda = torch.device("cuda")
    assert attention.flash_attention_usable(cuda, torch.float16, 256, "auto")
    assert not attention.flash_attention_usable(cuda, torch.float16, 256, "int8")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_tokenizer):
    """A random-weight Llama with 64-wide heads (2 kv heads for 4 query heads), tp 1 and tp 2."""
    config = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=256,
                         intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, initializer_range=0.1)
    root = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(root / "hf", LlamaForCausalLM, config, smollm2_tokenizer)
    return {tp: convert(str(root / "hf"), root / f"tp{tp}", dtype="float32", tp=tp)
            for tp in (1, 2)}


@pytest.fixture(scope="module")
def chat_prompts(smollm2_tokenizer):
    return [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True, return_dict=False)
            for q in QUESTIONS]


@pytest.mark.parametrize("dtype, ratio", [("float32", 256 / 66), ("bfloat16", 128 / 66),
                                          ("float16", 128 / 66)])
def test_int8_holds_the_blocks_its_bytes_allow(tiny_llama, dtype, ratio):
    """2 layers x K and V x 2 kv heads x 16 tokens x (64 int8 values + a 2-byte scale)."""
    memory = 1 << 22
    full = LLM(str(tiny_llama[1]), dtype=dtype, kv_cache_memory=memory).engine.runner.num_blocks
    int8 = LLM(str(tiny_llama[1]), dtype=dtype, kv_cache_memory=memory,
               kv_cache_dtype="int8").engine.runner.num_blocks
    assert int8 == memory // (2 * 2 * 2 * 16 * (64 + 2))
    assert int8 / full == pytest.approx(ratio, rel=0.01)


def forced_agreement(repo: str, prompts: list[list[int]]) -> tuple[float, float]:
    """Teacher forcing: after each prefix of the float32 cache's greedy continuation, the int8
    cache's greedy token. Returns the fraction of positions where it is the same token, and the
    largest difference of that token's logprob between the two caches."""
    reference = LLM(repo).generate(prompts, GREEDY)
    forced = [p + out.token_ids[:i] for p, out in zip(prompts, reference)
              for i in range(len(out.token_ids))]
    quantized = LLM(repo, kv_cache_dtype="int8").generate(
        forced, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=1))
    wanted = [(token, lp["logprob"]) for out in reference
              for token, lp in zip(out.token_ids, out.logprobs)]
    same = [abs(out.logprobs[0]["logprob"] - logprob)
            for out, (token, logprob) in zip(quantized, wanted) if out.token_ids == [token]]
    return len(same) / len(wanted), max(same)


@pytest.mark.parametrize("model", ["tiny-llama", "smollm2"])
def test_greedy_tokens_and_logprobs_stay_close_to_float32_kv(tiny_llama, smollm2_repo,
                                                             smollm2_tokenizer, model):
    repo = str(tiny_llama[1] if model == "tiny-llama" else smollm2_repo)
    agreement, largest = forced_agreement(repo, [smollm2_tokenizer.encode(text) for text in TEXTS])
    print(f"{model}: {agreement:.0%} of tokens agree, their logprobs differ by <= {largest:.3f}")
    assert agreement >= 0.9 and largest <= 0.15


def test_batched_preempted_and_alone_give_the_same_tokens(smollm2_repo, chat_prompts):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(smollm2_repo), kv_cache_dtype="int8")
    alone = [llm.generate([p], params)[0].token_ids for p in chat_prompts]
    assert [o.token_ids for o in llm.generate(chat_prompts, params)] == alone
    tiny = LLM(str(smollm2_repo), kv_cache_dtype="int8", num_kv_blocks=8, block_size=16,
               admission_headroom_blocks=0)
    assert [o.token_ids for o in tiny.generate(chat_prompts, params)] == alone
    assert tiny.engine.scheduler.num_preemptions > 0


def test_prefix_cache_gives_the_same_tokens(smollm2_repo, smollm2_tokenizer):
    system = ("You are a careful assistant. Answer in one short sentence, mention the subject by "
              "name, avoid lists, and never apologise. Today is a quiet day by the sea.")
    prompts = [smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": q}],
        add_generation_prompt=True, return_dict=False) for q in QUESTIONS[:3]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cached = LLM(str(smollm2_repo), kv_cache_dtype="int8")
    warm = cached.generate(prompts[:1], params) + cached.generate(prompts[1:], params)
    assert cached.engine.scheduler.prefix_cache_hits >= 2 * 32
    uncached = LLM(str(smollm2_repo), kv_cache_dtype="int8", enable_prefix_caching=False)
    assert [o.token_ids for o in warm] == [o.token_ids for o in uncached.generate(prompts, params)]


def test_forked_sequences_copy_the_partial_block_with_its_scales(tiny_llama, smollm2_tokenizer):
    llm = LLM(str(tiny_llama[1]), kv_cache_dtype="int8", block_size=8)
    text = "The history of the Roman Empire spans many centuries. " * 4
    prompt = smollm2_tokenizer.encode(text)[:36]  # 4 full blocks and a partial one
    sampled = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    forked, = llm.generate([prompt], SamplingParams(n=3, seed=5, **sampled))
    for index, choice in enumerate(forked.choices):
        seed = (5 + index * _SEED_STRIDE) % (1 << 63)
        alone, = llm.generate([prompt], SamplingParams(seed=seed, **sampled))
        assert choice.token_ids == alone.token_ids


def test_t5_cross_attention_and_preemption(tmp_path, smollm2_tokenizer):
    config = T5Config(vocab_size=len(smollm2_tokenizer), d_model=64, d_kv=16, d_ff=128,
                      num_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                      eos_token_id=1, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    save_tiny(tmp_path / "hf", T5ForConditionalGeneration, config, smollm2_tokenizer)
    repo = str(convert(str(tmp_path / "hf"), tmp_path / "repo", dtype="float32"))
    prompts = random_prompts(6, config.vocab_size)
    reference = LLM(repo, block_size=8).generate(prompts, GREEDY)
    tiny = LLM(repo, block_size=8, num_kv_blocks=16, kv_cache_dtype="int8",
               admission_headroom_blocks=0)
    quantized = tiny.generate(prompts, GREEDY)
    assert tiny.engine.scheduler.num_preemptions > 0
    # Tokens until each output's first difference (the texts go different ways after it).
    agreed = [next((i for i, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b),
                   len(ref.token_ids)) for ref, out in zip(reference, quantized)]
    largest = max(abs(a["logprob"] - b["logprob"])
                  for ref, out, n in zip(reference, quantized, agreed)
                  for a, b in zip(ref.logprobs[:n], out.logprobs[:n]))
    total = GREEDY.max_tokens * len(prompts)
    print(f"t5: {sum(agreed)} of {total} tokens agree, logprobs differ by <= {largest:.3f}")
    assert sum(agreed) >= 0.75 * total and largest <= 0.15


def test_two_ranks_give_one_ranks_tokens(tiny_llama, smollm2_tokenizer):
    prompts = random_prompts(3, len(smollm2_tokenizer), max_len=24)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for tp, repo in tiny_llama.items():
        with LLM(str(repo), kv_cache_dtype="int8", block_size=8) as llm:
            outputs[tp] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs[2] == outputs[1]
