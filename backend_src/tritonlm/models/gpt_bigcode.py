"""GPT-BigCode family: SantaCoder, StarCoder. Learned positions, multi-query or multi-head attention."""
import torch
from torch import nn

from tritonlm.layers.attention import PagedAttention
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.causal_lm_head import CausalLM
from tritonlm.layers.fused_qkv import split_grouped_qkv
from tritonlm.layers.linear import QKVParallelLinear, RowParallelLinear
from tritonlm.layers.mlp import MLP


class GPTBigCodeAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // num_heads
        # c_attn holds all queries then the one key and value (multi-query), or (q, k, v) head by
        # head: the grouped layout with one group or a group per head.
        self.c_attn = QKVParallelLinear(hidden, num_heads, 1 if config.multi_query else num_heads,
                                        self.head_dim, bias=True, grouped=True)
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        scale = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        self.attn = PagedAttention(self.c_attn.num_heads, self.c_attn.num_kv_heads, self.head_dim,
                                   scale)

    def forward(self, x, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = split_grouped_qkv(self.c_attn(x), self.c_attn.num_kv_heads, self.head_dim)
        return self.c_proj(self.attn(q, k, v, meta).flatten(1))


class GPTBigCodeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.ln_1 = nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)
        self.attn = GPTBigCodeAttention(config)
        self.ln_2 = nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)
        self.mlp = MLP(hidden, config.n_inner or 4 * hidden, config.activation_function, bias=True,
                       names=("c_fc", "c_proj"))

    def forward(self, x, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), meta)
        return x + self.mlp(self.ln_2(x))


class GPTBigCodeModel(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPTBigCodeBlock(config) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, meta)
        return self.ln_f(x)


class GPTBigCodeForCausalLM(CausalLM):
    decoder_class = GPTBigCodeModel
    decoder_name, embedding_name = "transformer", "wte"
    # The causal-mask buffers some exports saved alongside the weights.
    ignored_checkpoint_tensors = r"transformer\.bias|transformer\.h\.\d+\.attn\.(bias|masked_bias)"
