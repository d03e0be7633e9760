"""GPT-NeoX family: Pythia, GPT-NeoX-20B. Partial rotary, parallel or sequential residual."""
import torch
from torch import nn

from tritonlm.layers.attention import PagedAttention
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.fused_qkv import split_per_head_qkv
from tritonlm.layers.mlp import MLP
from tritonlm.layers.rotary import RotaryEmbedding


def _head_dim(config) -> int:
    return config.hidden_size // config.num_attention_heads


class GPTNeoXAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = _head_dim(config)
        hidden = config.hidden_size
        self.query_key_value = nn.Linear(hidden, 3 * hidden, bias=config.attention_bias)
        self.dense = nn.Linear(hidden, hidden, bias=config.attention_bias)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, positions, x, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = split_per_head_qkv(self.query_key_value(x), self.num_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.dense(self.attn(q, k, v, meta).flatten(1))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = GPTNeoXAttention(config, rotary)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=True,
                       names=("dense_h_to_4h", "dense_4h_to_h"))

    def forward(self, positions, x, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.attention(positions, self.input_layernorm(x), meta)
        if self.use_parallel_residual:  # attention and MLP both read the layer's input
            return self.mlp(self.post_attention_layernorm(x)) + attn + x
        x = attn + x
        return self.mlp(self.post_attention_layernorm(x)) + x


class GPTNeoXModel(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        rotary_factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
        rotary = RotaryEmbedding(config, int(_head_dim(config) * rotary_factor), max_positions)
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GPTNeoXLayer(config, rotary)
                                    for _ in range(config.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_in(input_ids)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.final_layer_norm(x)


class GPTNeoXForCausalLM(nn.Module):
    # Buffers that older exports (Pythia) saved alongside the weights.
    ignored_checkpoint_tensors = r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)"

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.gpt_neox = GPTNeoXModel(config, max_positions)
        self.tie_word_embeddings = config.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.gpt_neox(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.gpt_neox.embed_in.weight if self.tie_word_embeddings else self.embed_out.weight
        return torch.nn.functional.linear(hidden, weight)
