"""Feed-forward blocks: the gated (SwiGLU-style) MLP and the plain two-layer one. Tensor-parallel:
each rank computes its slice of the intermediate features; the down projection sums the ranks."""
import torch
from torch import nn

from tritonlm.layers import fused_ops
from tritonlm.layers.activation import FUSED_CODES, activation
from tritonlm.layers.linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one matmul (this rank's gate slice, then its
    up slice)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool):
        super().__init__()
        self.fused_code = FUSED_CODES.get(act)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias,
                                                 gated=self.fused_code is not None)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_code is not None:
            hidden = self.gate_up_proj.act_and_mul(x, self.fused_code)
            if hidden is not None:
                return self.down_proj(hidden)
        gate_up = self.gate_up_proj(x)
        kernels = fused_ops.for_tensor(gate_up)
        if kernels is None or self.fused_code is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        flat = gate_up.reshape(-1, gate_up.shape[-1])
        hidden = kernels.act_and_mul(flat, self.fused_code)
        return self.down_proj(hidden.view(*gate_up.shape[:-1], -1))


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
