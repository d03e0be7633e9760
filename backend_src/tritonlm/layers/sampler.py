"""Batched sampling with per-row parameters: one pass over [rows, vocab], no per-row Python.

Order: the watermark (TGI's: first), logit_bias, then penalties, on the raw logits, then the
grammar masks (structured output), then temperature, then the truncations
(top-k, top-p, min-p, typical), then a draw. Random draws come from a counter-based hash of
(seed, output index, token id), so a request's samples depend only on its own seed and inputs,
never on the batch or device.
Reported logprobs are those of the model's raw distribution.
"""
from dataclasses import dataclass

import torch

from tritonlm.layers import fused_ops

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_STEP = _signed(0xD1B54A32D192ED03)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    # logical shift on int64 (torch's >> is arithmetic)
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] uniforms in (0, 1) from splitmix64 of (seed, step, token id): 23 bits, so
    the largest, 1 - 2**-24, is still below 1 in float32 (24 bits rounded it to 1.0, whose
    exponential draw, 0, made a token of zero probability win the race as 0 / 0)."""
    token = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _GOLDEN + steps[:, None] * _STEP + token[None, :]
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 41).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_k: torch.Tensor  # [S] int64, 0 = off
    top_p: torch.Tensor  # [S] float32, 1 = off
    min_p: torch.Tensor  # [S] float32, 0 = off
    typical_p: torch.Tensor  # [S] float32, 1 = off
    repetition_penalty: torch.Tensor  # [S] float32, 1 = off
    presence_penalty: torch.Tensor  # [S] float32, 0 = off
    frequency_penalty: torch.Tensor  # [S] float32, 0 = off
    seeds: torch.Tensor  # [S] int64
    steps: torch.Tensor  # [S] int64
    num_logprobs: int  # top alternatives to report per row (the largest any row asked for)
    banned_rows: torch.Tensor  # [K] with banned_tokens: (row, token) pairs that must not be chosen
    banned_tokens: torch.Tensor  # [K]
    all_greedy: bool
    needs_truncation: bool
    # Token history for penalties ([S, V]), None when no row uses a penalty.
    seen: torch.Tensor | None = None  # bool: in the prompt or the output so far
    output_counts: torch.Tensor | None = None  # occurrences in the output so far
    # logit_bias as (row, token, value) triples ([B] each), None when no row has one.
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Watermarked rows [W] and their green lists [W, V] bool (tritonlm/watermark.py), None when
    # no row asks; delta is added on the green lists.
    watermark_rows: torch.Tensor | None = None
    green_lists: torch.Tensor | None = None
    watermark_delta: float = 0.0
    # Constrained rows [C] and their grammar masks [C, ceil(V / 32)] int32 (bit t of a row:
    # token t allowed), None when no row is constrained.
    bitmask_rows: torch.Tensor | None = None
    token_bitmask: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [S]
    logprobs: torch.Tensor  # [S] of the chosen tokens
    top_ids: torch.Tensor  # [S, N]
    top_logprobs: torch.Tensor  # [S, N]


def sample(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """logits [S, V] -> chosen tokens with their logprobs and the top-N alternatives."""
    kernels = fused_ops.for_tensor(logits)
    if (kernels is not None and t.all_greedy and t.seen is None and not t.banned_rows.numel()
            and t.bias_rows is None and t.watermark_rows is None and t.bitmask_rows is None
            and logits.stride(-1) == 1):
        tokens, normalizer = kernels.argmax_logsumexp(logits)  # one pass, no float32 copy
        return _with_logprobs(logits, tokens, normalizer[:, None], t.num_logprobs)
    raw = logits.float()
    logits = raw
    if t.watermark_rows is not None:
        logits = logits.index_add(0, t.watermark_rows, t.green_lists * t.watermark_delta)
    if t.bias_rows is not None:
        logits = logits.index_put((t.bias_rows, t.bias_tokens), t.bias_values, accumulate=True)
    if t.seen is not None:
        logits = apply_penalties(logits, t)
    if t.banned_rows.numel():
        logits = logits.index_put((t.banned_rows, t.banned_tokens),
                                  torch.tensor(float("-inf"), device=logits.device))
    if t.bitmask_rows is not None:
        allowed = unpack_bitmask(t.token_bitmask, logits.shape[-1])
        logits = logits.index_copy(0, t.bitmask_rows, logits[t.bitmask_rows].masked_fill(
            ~allowed, float("-inf")))
    tokens = logits.argmax(dim=-1)
    if not t.all_greedy:
        greedy = t.temperature == 0
        scaled = logits / torch.where(greedy, 1.0, t.temperature)[:, None]
        if t.needs_truncation:
            scaled = truncate(scaled, t)
        probs = torch.softmax(scaled, dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
        exponential = -torch.log(uniform_noise(t.seeds, t.steps, logits.shape[-1]))
        tokens = torch.where(greedy, tokens, (probs / exponential).argmax(dim=-1))
    return _with_logprobs(raw, tokens, torch.logsumexp(raw, dim=-1, keepdim=True),
                          t.num_logprobs)


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] -> each row's most likely token, through the fused kernel where it runs
    (torch's argmax over bfloat16 logits took a CPU 0.2 ms a row of SmolLM2's 49152)."""
    kernels = fused_ops.for_tensor(logits)
    if kernels is not None and logits.stride(-1) == 1:
        return kernels.argmax_logsumexp(logits)[0]
    return logits.argmax(dim=-1)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token bitmasks [C, ceil(V / 32)] int32 (bit t % 32 of word t // 32) as bools [C, V]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, normalizer: torch.Tensor,
                   num_logprobs: int) -> SamplerOutput:
    """Logprobs of the model's raw distribution (logits `raw`, normalizer [S, 1] float32) for the
    chosen tokens and the top `num_logprobs`."""
    chosen = raw.gather(-1, tokens[:, None]).float() - normalizer
    top_values, top_ids = raw.topk(num_logprobs, dim=-1)
    return SamplerOutput(tokens, chosen.squeeze(-1), top_ids, top_values.float() - normalizer)


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """HF's repetition penalty over prompt and output; OpenAI's presence/frequency over output."""
    penalty = t.repetition_penalty[:, None]
    repeated = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(t.seen, repeated, logits)
    counts = t.output_counts.float()
    return (logits - t.frequency_penalty[:, None] * counts
            - t.presence_penalty[:, None] * (counts > 0).float())


def truncate(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask (with -inf) what top-k, top-p, min-p and typical decoding exclude, per row."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    # top-k keeps ties with the k-th largest logit, as transformers does
    k = torch.where(t.top_k > 0, t.top_k, vocab).clamp(max=vocab)
    drop = sorted_logits < sorted_logits.gather(-1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # top-p: keep the smallest prefix whose probability reaches top_p
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= (mass_before >= t.top_p[:, None]) & (t.top_p[:, None] < 1)
    # min-p: drop what is less likely than min_p times the most likely token
    drop |= sorted_probs < t.min_p[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False
    kept = torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return _typical(kept, t.typical_p) if bool((t.typical_p < 1).any()) else kept


def _typical(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    # Keep the tokens whose surprise is closest to the entropy until their mass reaches typical_p.
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum(dim=-1, keepdim=True)
    distance, order = (-log_probs - entropy).abs().sort(dim=-1)
    cumulative = probs.gather(-1, order).cumsum(dim=-1)
    last = (cumulative < typical_p[:, None]).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    drop = distance > distance.gather(-1, last)
    drop[:, 0] = False
    drop &= (typical_p < 1)[:, None]
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
