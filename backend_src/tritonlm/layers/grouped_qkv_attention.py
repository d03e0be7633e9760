"""Attention with one fused `query_key_value` projection in the grouped layout (layers/fused_qkv.py)
and a `dense` output, as GPT-NeoX, Falcon and BLOOM name them; rotary or a position bias."""
import torch
from torch import nn

from tritonlm.layers.attention import PagedAttention
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.fused_qkv import split_grouped_qkv
from tritonlm.layers.rotary import Rope, apply_rotary


class GroupedQKVAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, bias: bool,
                 position_bias: nn.Module | None = None):
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        qkv_size = (num_heads + 2 * num_kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(hidden_size, qkv_size, bias=bias)
        self.dense = nn.Linear(num_heads * self.head_dim, hidden_size, bias=bias)
        self.attn = PagedAttention(num_heads, num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                   position_bias=position_bias)

    def forward(self, x, meta: AttentionMetadata, rope: Rope | None = None) -> torch.Tensor:
        q, k, v = split_grouped_qkv(self.query_key_value(x), self.num_kv_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.dense(self.attn(q, k, v, meta).flatten(1))
