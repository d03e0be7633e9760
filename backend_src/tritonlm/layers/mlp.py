"""Gated MLP (SwiGLU-style): down(act(gate(x)) * up(x)), gate and up in one matmul."""
import torch
from torch import nn

from tritonlm.layers.activation import activation


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
