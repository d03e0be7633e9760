"""BLOOM family: ALiBi, a layer norm on the embeddings, per-head fused query_key_value."""
import torch
from torch import nn

from tritonlm.layers.alibi import ALiBi, bloom_slopes
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.causal_lm_head import CausalLM
from tritonlm.layers.grouped_qkv_attention import GroupedQKVAttention
from tritonlm.layers.mlp import MLP


class BloomBlock(nn.Module):
    def __init__(self, config, alibi: ALiBi):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        heads = config.num_attention_heads
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attention = GroupedQKVAttention(hidden, heads, heads, bias=True,
                                                  position_bias=alibi)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        # BLOOM's gelu is the tanh approximation (its constant rounded to 0.79788456).
        self.mlp = MLP(hidden, 4 * hidden, "gelu_pytorch_tanh", bias=True,
                       names=("dense_h_to_4h", "dense_4h_to_h"))
        self.residual_from_norm = config.apply_residual_connection_post_layernorm

    def forward(self, x, meta: AttentionMetadata) -> torch.Tensor:
        normed = self.input_layernorm(x)
        residual = normed if self.residual_from_norm else x
        x = residual + self.self_attention(normed, meta)
        normed = self.post_attention_layernorm(x)
        return (normed if self.residual_from_norm else x) + self.mlp(normed)


class BloomModel(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        alibi = ALiBi(bloom_slopes(config.num_attention_heads))
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.word_embeddings_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.h = nn.ModuleList(BloomBlock(config, alibi) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(hidden, eps=eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.word_embeddings_layernorm(self.word_embeddings(input_ids))
        for block in self.h:
            x = block(x, meta)
        return self.ln_f(x)


class BloomForCausalLM(CausalLM):
    decoder_class = BloomModel
    decoder_name, embedding_name = "transformer", "word_embeddings"
