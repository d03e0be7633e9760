"""The batched sampler: greedy, temperature, top-k, top-p and seeds, per row."""
import pytest
import torch

from tritonlm.layers.sampler import SamplingTensors, argmax_tokens, sample, uniform_noise

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
CHI2_DF7_P001 = 24.32  # chi-square critical value, 7 degrees of freedom, p = 0.001


def tensors(rows, temperature=1.0, top_k=0, top_p=1.0, seeds=None, steps=None, **extra):
    def full(value, dtype):
        return value if torch.is_tensor(value) else torch.full((rows,), value, dtype=dtype)
    floats = {"min_p": 0.0, "typical_p": 1.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
              "frequency_penalty": 0.0}
    floats.update({k: v for k, v in extra.items() if k in floats})
    t, k, p = full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32)
    floats = {name: full(value, torch.float32) for name, value in floats.items()}
    return SamplingTensors(
        temperature=t, top_k=k, top_p=p, **floats,
        seeds=seeds if seeds is not None else torch.arange(rows, dtype=torch.int64),
        steps=steps if steps is not None else torch.zeros(rows, dtype=torch.int64),
        num_logprobs=extra.get("num_logprobs", 0), all_greedy=bool((t == 0).all()),
        banned_rows=torch.zeros(0, dtype=torch.int64), banned_tokens=torch.zeros(0, dtype=torch.int64),
        needs_truncation=bool(((k > 0) | (p < 1) | (floats["min_p"] > 0)
                               | (floats["typical_p"] < 1)).any()),
        seen=extra.get("seen"), output_counts=extra.get("output_counts"))


def frequencies(n, **kw):
    tokens = sample(LOGITS.expand(n, -1), tensors(n, **kw)).tokens
    return torch.bincount(tokens, minlength=LOGITS.numel()).double()


def test_temperature_one_matches_softmax_chi_square():
    n = 20000
    observed = frequencies(n)
    expected = torch.softmax(LOGITS.double(), -1) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_DF7_P001


def test_temperature_scales_the_distribution():
    n = 20000
    observed = frequencies(n, temperature=0.5)
    expected = torch.softmax(LOGITS.double() / 0.5, -1) * n
    assert float(((observed - expected) ** 2 / expected).sum()) < CHI2_DF7_P001


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.randn(6, 50)
    temperature = torch.tensor([0, 1, 0, 1, 0, 1], dtype=torch.float32)
    out = sample(logits, tensors(6, temperature=temperature)).tokens
    assert torch.equal(out[::2], logits[::2].argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_tokens_is_torchs_argmax(dtype):
    """A draft model's tokens (argmax_tokens: the fused kernel where it runs) for contiguous and
    strided rows of a SmolLM2-sized vocabulary."""
    logits = torch.randn(5, 49152, generator=torch.Generator().manual_seed(3)).to(dtype)
    for rows in (logits, logits[::2], logits[:, :1000]):
        assert torch.equal(argmax_tokens(rows), rows.argmax(dim=-1))


def test_top_k_never_emits_excluded_tokens():
    allowed = set(torch.topk(LOGITS, 3).indices.tolist())
    observed = frequencies(5000, top_k=3)
    assert {i for i, c in enumerate(observed.tolist()) if c} == allowed


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1)
    order = probs.argsort(descending=True)
    cumulative = probs[order].cumsum(0)
    keep = int((cumulative < 0.7).sum()) + 1
    allowed = set(order[:keep].tolist())
    observed = frequencies(5000, top_p=0.7)
    assert {i for i, c in enumerate(observed.tolist()) if c} == allowed


def test_seeded_rows_do_not_depend_on_the_batch():
    vocab = 1000
    logits = torch.randn(1, vocab)
    seed, step = torch.tensor([1234]), torch.tensor([5])
    alone = sample(logits, tensors(1, seeds=seed, steps=step)).tokens
    batch_logits = torch.cat([torch.randn(7, vocab), logits, torch.randn(4, vocab)])
    seeds = torch.cat([torch.arange(7), seed, torch.arange(4)])
    steps = torch.cat([torch.zeros(7, dtype=torch.int64), step, torch.ones(4, dtype=torch.int64)])
    top_k = torch.tensor([0] * 7 + [0] + [5] * 4)
    in_batch = sample(batch_logits, tensors(12, seeds=seeds, steps=steps, top_k=top_k)).tokens
    assert in_batch[7] == alone[0]


def test_different_seeds_and_steps_give_different_draws():
    logits = torch.zeros(64, 1000)  # uniform: every draw is pure noise
    by_seed = sample(logits, tensors(64)).tokens
    assert len(set(by_seed.tolist())) > 50
    steps = torch.arange(64, dtype=torch.int64)
    by_step = sample(logits, tensors(64, seeds=torch.full((64,), 7), steps=steps)).tokens
    assert len(set(by_step.tolist())) > 50


def test_noise_stays_below_one_so_zero_probability_tokens_never_win():
    # Over 2**24 token ids seed 0 reaches the largest draw; rounded to 1.0 its exponential race
    # entry is 0 and a zero-probability token's 0 / 0 (NaN) wins the argmax.
    noise = uniform_noise(torch.tensor([0]), torch.tensor([0]), 1 << 24)
    assert noise.max().item() < 1 and noise.min().item() > 0
    probs = torch.zeros(1, 1 << 24)
    probs[0, :2] = 0.5
    assert (probs / -torch.log(noise)).argmax().item() in (0, 1)
