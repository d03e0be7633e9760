"""Llama family: Llama / Llama 2 / Code Llama / Mistral-style GQA, SmolLM2."""
import torch
from torch import nn

from tritonlm.layers.attention import PagedAttention
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.mlp import GatedMLP
from tritonlm.layers.norm import RMSNorm
from tritonlm.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        self.split = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.qkv_proj = nn.Linear(hidden, sum(self.split), bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5, getattr(config, "sliding_window", None))

    def forward(self, positions, x, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta).flatten(1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            getattr(config, "mlp_bias", False))

    def forward(self, positions, x, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(config, head_dim, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    # Fused projections, loaded by concatenating the checkpoint's separate ones.
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                      "gate_up_proj": ("gate_proj", "up_proj")}
    ignored_checkpoint_tensors = r".*rotary_emb\.inv_freq"

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.model = LlamaModel(config, max_positions)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)
