"""Batched sampling with per-row parameters: one pass over [rows, vocab], no per-row Python.

Random draws come from a counter-based hash of (seed, output index, token id), so a request's
samples depend only on its own seed and inputs, never on batch composition or device.
"""
from dataclasses import dataclass

import torch

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
    """[rows, vocab] uniforms in (0, 1) from splitmix64 of (seed, step, token id)."""
    token = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _GOLDEN + steps[:, None] * _STEP + token[None, :]
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_k: torch.Tensor  # [S] int64, 0 = off
    top_p: torch.Tensor  # [S] float32
    seeds: torch.Tensor  # [S] int64
    steps: torch.Tensor  # [S] int64
    all_greedy: bool
    needs_truncation: bool  # some row uses top_k or top_p


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [S, V] -> token ids [S]."""
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy_tokens
    greedy = t.temperature == 0
    scaled = logits / torch.where(greedy, 1.0, t.temperature)[:, None]
    if t.needs_truncation:
        scaled = _truncate(scaled, t.top_k, t.top_p)
    probs = torch.softmax(scaled, dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
    exponential = -torch.log(uniform_noise(t.seeds, t.steps, logits.shape[-1]))
    sampled = (probs / exponential).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, sampled)


def _truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
    drop = rank >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose probability reaches top_p (the first token always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
