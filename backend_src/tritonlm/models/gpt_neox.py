"""GPT-NeoX family: Pythia, GPT-NeoX-20B. Partial rotary, parallel or sequential residual."""
import torch
from torch import nn

from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.causal_lm_head import CausalLM
from tritonlm.layers.grouped_qkv_attention import GroupedQKVAttention
from tritonlm.layers.mlp import MLP
from tritonlm.layers.rotary import Rope, RotaryEmbedding


class GPTNeoXLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        # query_key_value holds (q, k, v) head by head: the grouped layout with a group per head.
        self.attention = GroupedQKVAttention(hidden, heads, heads, config.attention_bias)
        self.mlp = MLP(hidden, config.intermediate_size, config.hidden_act, bias=True,
                       names=("dense_h_to_4h", "dense_4h_to_h"))

    def forward(self, rope: Rope, x, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(x), meta, rope)
        if self.use_parallel_residual:  # attention and MLP both read the layer's input
            return self.mlp(self.post_attention_layernorm(x)) + attn + x
        x = attn + x
        return self.mlp(self.post_attention_layernorm(x)) + x


class GPTNeoXModel(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        rotary_dim = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        self.rotary_emb = RotaryEmbedding(config, rotary_dim, max_positions)
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GPTNeoXLayer(config) for _ in range(config.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_in(input_ids)
        rope = self.rotary_emb.cos_sin(positions, meta, x.dtype)
        for layer in self.layers:
            x = layer(rope, x, meta)
        return self.final_layer_norm(x)


class GPTNeoXForCausalLM(CausalLM):
    decoder_class = GPTNeoXModel
    decoder_name, embedding_name, head_name = "gpt_neox", "embed_in", "embed_out"
    # Buffers that older exports (Pythia) saved alongside the weights.
    ignored_checkpoint_tensors = r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)"
