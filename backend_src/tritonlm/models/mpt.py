"""MPT family (MosaicML MPT-7B / 30B, Replit code models): ALiBi, bias-free layers.

Follows transformers' port, which always builds bias-free layers, a 4x MLP and ALiBi with
alibi_bias_max 8, whatever `no_bias`, `expansion_ratio` and `attn_config.alibi_bias_max` say;
a checkpoint that does carry biases or another MLP width is refused by the loader."""
import torch
from torch import nn

from tritonlm.layers.alibi import ALiBi, mpt_slopes
from tritonlm.layers.attention import PagedAttention
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.causal_lm_head import CausalLM
from tritonlm.layers.linear import QKVParallelLinear, RowParallelLinear
from tritonlm.layers.mlp import MLP

# transformers builds the bias with its default, not the config's alibi_bias_max.
ALIBI_BIAS_MAX = 8


class MptAttention(nn.Module):
    def __init__(self, config, alibi: ALiBi):
        super().__init__()
        hidden, heads = config.hidden_size, config.n_heads
        self.head_dim = hidden // heads
        self.clip_qkv = config.attn_config.clip_qkv
        scale = config.attn_config.softmax_scale
        scale = self.head_dim ** -0.5 if scale is None else scale
        self.Wqkv = QKVParallelLinear(hidden, heads, heads, self.head_dim, bias=False)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=False)
        self.num_heads = self.Wqkv.num_heads  # this tensor-parallel rank's
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, scale,
                                   position_bias=alibi)

    def forward(self, x, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.Wqkv(x)
        if self.clip_qkv:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        return self.out_proj(self.attn(q, k, v, meta).flatten(1))


class MptBlock(nn.Module):
    def __init__(self, config, alibi: ALiBi):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.norm_1 = nn.LayerNorm(hidden, eps=eps, bias=False)
        self.attn = MptAttention(config, alibi)
        self.norm_2 = nn.LayerNorm(hidden, eps=eps, bias=False)
        self.ffn = MLP(hidden, 4 * hidden, "gelu", bias=False)

    def forward(self, x, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), meta)
        return x + self.ffn(self.norm_2(x))


class MptModel(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        alibi = ALiBi(mpt_slopes(config.n_heads, ALIBI_BIAS_MAX))
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(MptBlock(config, alibi) for _ in range(config.n_layers))
        self.norm_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids)
        for block in self.blocks:
            x = block(x, meta)
        return self.norm_f(x)


class MptForCausalLM(CausalLM):
    decoder_class = MptModel
    decoder_name, embedding_name = "transformer", "wte"
