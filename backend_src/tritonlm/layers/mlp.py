"""Feed-forward blocks: the gated (SwiGLU-style) MLP and the plain two-layer one. Tensor-parallel:
each rank computes its slice of the intermediate features; the down projection sums the ranks."""
import torch
from torch import nn

from tritonlm.layers.activation import activation
from tritonlm.layers.linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one matmul (this rank's gate slice, then its
    up slice)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class MLP(nn.Module):
    """down(act(up(x))), the two projections named as the family's checkpoint names them."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool,
                 names: tuple[str, str] = ("up_proj", "down_proj")):
        super().__init__()
        self.up_name, self.down_name = names
        self.add_module(self.up_name, ColumnParallelLinear(hidden_size, intermediate_size, bias))
        self.add_module(self.down_name, RowParallelLinear(intermediate_size, hidden_size, bias))
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.down_name)(self.act(getattr(self, self.up_name)(x)))
