"""Gated MLP (SwiGLU-style): down(act(gate(x)) * up(x))."""
import torch
from torch import nn

from tritonlm.layers.activation import activation


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
