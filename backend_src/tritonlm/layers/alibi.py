"""ALiBi: a per-head linear penalty on how far back a key lies, added to attention scores."""
import math

import torch
from torch import nn

from tritonlm.distributed import parallel_state
from tritonlm.layers.linear import local_head_range


def bloom_slopes(num_heads: int) -> torch.Tensor:
    """Press et al.'s geometric slopes; a head count that is not a power of two takes the rest from
    every other slope of the next power of two."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = base ** torch.arange(1, closest + 1, dtype=torch.float32, device="cpu")
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        extra = min(closest, num_heads - closest)
        slopes = torch.cat([slopes, extra_base ** torch.arange(1, 1 + 2 * extra, 2,
                                                               dtype=torch.float32, device="cpu")])
    return slopes


def mpt_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """MPT's slopes: 1 / 2^(max * i / n) over the next power of two, odd heads first if trimmed."""
    padded = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, padded + 1, dtype=torch.float32, device="cpu")
                             * (alibi_bias_max / padded))
    if padded != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


class ALiBi(nn.Module):
    """Built from the slopes of all heads; keeps those of this tensor-parallel rank's heads."""

    def __init__(self, slopes: torch.Tensor):
        super().__init__()
        tp = parallel_state.current()
        heads = local_head_range(len(slopes), tp.rank, tp.world_size)
        # The slope functions build on the CPU, so the values are real even when the model is
        # built on the meta device.
        self.register_buffer("slopes", slopes[heads.start:heads.stop].float(), persistent=False)

    def forward(self, distance: torch.Tensor) -> torch.Tensor:
        """distance: [..., L] key minus query position -> biases [..., H, L]."""
        return distance.unsqueeze(-2).float() * self.slopes[:, None]
