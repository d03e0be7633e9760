"""Attention with one fused `query_key_value` projection in the grouped layout (layers/fused_qkv.py)
and a `dense` output, as GPT-NeoX, Falcon and BLOOM name them; rotary or a position bias.
Tensor-parallel by heads: a rank projects its query heads and their kv groups."""
import torch
from torch import nn

from tritonlm.layers.attention import PagedAttention
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.fused_qkv import split_grouped_qkv
from tritonlm.layers.linear import QKVParallelLinear, RowParallelLinear
from tritonlm.layers.rotary import Rope, apply_rotary


class GroupedQKVAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, bias: bool,
                 position_bias: nn.Module | None = None):
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.query_key_value = QKVParallelLinear(hidden_size, num_heads, num_kv_heads,
                                                 self.head_dim, bias, grouped=True)
        self.dense = RowParallelLinear(num_heads * self.head_dim, hidden_size, bias)
        local = self.query_key_value
        self.attn = PagedAttention(local.num_heads, local.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5, position_bias=position_bias)

    def forward(self, x, meta: AttentionMetadata, rope: Rope | None = None) -> torch.Tensor:
        q, k, v = split_grouped_qkv(self.query_key_value(x), self.query_key_value.num_kv_heads,
                                    self.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.dense(self.attn(q, k, v, meta).flatten(1))
