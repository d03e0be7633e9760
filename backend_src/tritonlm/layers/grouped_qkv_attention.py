"""Attention with one fused `query_key_value` projection laid out kv group by kv group, each group
holding its queries, then its key, then its value: [groups, queries_per_group + 2, head_dim].

Falcon's three layouts and BLOOM's are all this one: per head (groups = heads), multi-query
(one group) and Falcon 40B's grouped kv heads."""
import torch
from torch import nn

from tritonlm.layers.attention import PagedAttention
from tritonlm.layers.attention_metadata import AttentionMetadata


def split_grouped_qkv(qkv: torch.Tensor, num_groups: int, head_dim: int):
    """[T, groups * (per_group + 2) * D] -> q [T, groups * per_group, D], k, v [T, groups, D]."""
    grouped = qkv.view(qkv.shape[0], num_groups, -1, head_dim)
    return grouped[:, :, :-2].flatten(1, 2), grouped[:, :, -2], grouped[:, :, -1]


class GroupedQKVAttention(nn.Module):
    """`query_key_value` and `dense` as Falcon and BLOOM name them; rotary or a position bias."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, bias: bool,
                 rotary: nn.Module | None = None, position_bias: nn.Module | None = None):
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        qkv_size = (num_heads + 2 * num_kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(hidden_size, qkv_size, bias=bias)
        self.dense = nn.Linear(num_heads * self.head_dim, hidden_size, bias=bias)
        self.rotary = rotary
        self.attn = PagedAttention(num_heads, num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                   position_bias=position_bias)

    def forward(self, positions, x, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = split_grouped_qkv(self.query_key_value(x), self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        return self.dense(self.attn(q, k, v, meta).flatten(1))
