"""GPT-BigCode family: SantaCoder, StarCoder. Learned positions, multi-query or multi-head attention."""
import torch
from torch import nn

from tritonlm.layers.attention import PagedAttention
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.fused_qkv import split_per_head_qkv
from tritonlm.layers.mlp import MLP


class GPTBigCodeAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.multi_query = config.multi_query
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        num_kv_heads = 1 if self.multi_query else self.num_heads
        self.c_attn = nn.Linear(hidden, hidden + 2 * num_kv_heads * self.head_dim)
        self.c_proj = nn.Linear(hidden, hidden)
        scale = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        self.attn = PagedAttention(self.num_heads, num_kv_heads, self.head_dim, scale)

    def forward(self, x, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.c_attn(x)
        if self.multi_query:  # all query heads, then the one shared key and value
            q, k, v = qkv.split([self.num_heads * self.head_dim, self.head_dim, self.head_dim], dim=-1)
            q = q.view(-1, self.num_heads, self.head_dim)
            k, v = k.unsqueeze(1), v.unsqueeze(1)
        else:
            q, k, v = split_per_head_qkv(qkv, self.num_heads, self.head_dim)
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
    def __init__(self, config):
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


class GPTBigCodeForCausalLM(nn.Module):
    # The causal-mask buffers some exports saved alongside the weights.
    ignored_checkpoint_tensors = r"transformer\.bias|transformer\.h\.\d+\.attn\.(bias|masked_bias)"

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.transformer = GPTBigCodeModel(config)
        self.tie_word_embeddings = config.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.transformer.wte.weight if self.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)
