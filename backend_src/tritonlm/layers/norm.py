"""Normalisation layers with Hugging Face numerics (statistics in float32). One fused kernel
(layers/fused_ops.py: C++ on CPU, Triton on CUDA) does the residual add and the normalisation
with the same roundings."""
import torch
from torch import nn

from tritonlm.layers import fused_ops


class RMSNorm(nn.Module):
    """Llama's: normalised in float32, cast back, then scaled by the weight."""
    offset = False  # Gemma's subclass scales by (1 + weight)

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, the pre-norm block's add as well: (norm(s), s) for
        s = x + residual, which the fused kernel writes over residual's storage."""
        kernels = fused_ops.for_tensor(x)
        if kernels is None or self.weight.dtype != x.dtype:
            if residual is None:
                return self.normalize(x)
            x = residual + x
            return self.normalize(x), x
        flat = x.reshape(-1, x.shape[-1])
        if residual is None:
            return kernels.rms_norm(flat, self.weight, self.eps, None, self.offset).view(x.shape)
        residual = residual.contiguous()
        out = kernels.rms_norm(flat, self.weight, self.eps, residual.view(flat.shape), self.offset)
        return out.view(x.shape), residual

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x).to(x.dtype)

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class OffsetRMSNorm(RMSNorm):
    """Gemma's: the weight is an offset from one, and the scaling happens in float32 before the
    cast back (Llama casts first)."""
    offset = True

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).to(x.dtype)
