"""Normalisation layers with Hugging Face numerics (statistics in float32)."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama's: normalised in float32, cast back, then scaled by the weight."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x).to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's: the weight is an offset from one, and the scaling happens in float32 before the
    cast back (Llama casts first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).to(x.dtype)
