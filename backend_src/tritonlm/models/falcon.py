"""Falcon family: 7B (multi-query, parallel attention), 40B / 180B (grouped kv heads, two norms),
RW (ALiBi, sequential residual)."""
import torch
from torch import nn

from tritonlm.layers.alibi import ALiBi, bloom_slopes
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.causal_lm_head import CausalLM
from tritonlm.layers.grouped_qkv_attention import GroupedQKVAttention
from tritonlm.layers.mlp import MLP
from tritonlm.layers.rotary import Rope, RotaryEmbedding


def _kv_groups(config) -> int:
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


def _falcon_alibi(config) -> ALiBi:
    # HF rounds the slopes to bfloat16, and adds the bias before the 1/sqrt(head_dim) scaling.
    slopes = bloom_slopes(config.num_attention_heads).bfloat16().float()
    return ALiBi(slopes * config.head_dim ** -0.5)


class FalconDecoderLayer(nn.Module):
    def __init__(self, config, alibi: ALiBi | None):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.self_attention = GroupedQKVAttention(hidden, config.num_attention_heads,
                                                  _kv_groups(config), config.bias, alibi)
        self.mlp = MLP(hidden, config.ffn_hidden_size, config.activation, config.bias,
                       names=("dense_h_to_4h", "dense_4h_to_h"))
        self.parallel_attn = config.parallel_attn
        num_norms = config.num_ln_in_parallel_attn or (2 if config.new_decoder_architecture else 1)
        self.two_norms = self.parallel_attn and num_norms == 2
        if self.two_norms:
            self.ln_attn = nn.LayerNorm(hidden, eps=eps)
            self.ln_mlp = nn.LayerNorm(hidden, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        if not self.parallel_attn:
            self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, rope: Rope | None, x, meta: AttentionMetadata) -> torch.Tensor:
        if not self.parallel_attn:
            x = x + self.self_attention(self.input_layernorm(x), meta, rope)
            return x + self.mlp(self.post_attention_layernorm(x))
        if self.two_norms:
            attn_in, mlp_in = self.ln_attn(x), self.ln_mlp(x)
        else:
            attn_in = mlp_in = self.input_layernorm(x)
        return x + (self.mlp(mlp_in) + self.self_attention(attn_in, meta, rope))


class FalconModel(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        if config.alibi:
            self.rotary_emb, alibi = None, _falcon_alibi(config)
        else:
            self.rotary_emb, alibi = RotaryEmbedding(config, config.head_dim, max_positions), None
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(FalconDecoderLayer(config, alibi)
                               for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        rope = (None if self.rotary_emb is None  # ALiBi models
                else self.rotary_emb.cos_sin(positions, meta, x.dtype))
        for layer in self.h:
            x = layer(rope, x, meta)
        return self.ln_f(x)


class FalconForCausalLM(CausalLM):
    decoder_class = FalconModel
    decoder_name, embedding_name = "transformer", "word_embeddings"
