"""Llama family: Llama / Llama 2 / Code Llama / Mistral-style GQA, SmolLM2; the base of Qwen2 and
Gemma, which override the hooks of LlamaModel (norm_class, attention, embed)."""
import torch
from torch import nn

from tritonlm.layers.attention import PagedAttention
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.causal_lm_head import CausalLM
from tritonlm.layers.linear import QKVParallelLinear, RowParallelLinear
from tritonlm.layers.mlp import GatedMLP
from tritonlm.layers.norm import RMSNorm
from tritonlm.layers.embedding import VocabEmbedding
from tritonlm.layers.rotary import Rope, RotaryEmbedding, apply_rotary


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, sliding_window: int | None, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.head_dim = head_dim(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.num_attention_heads,
                                          config.num_key_value_heads, self.head_dim, qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, o_bias)
        # This tensor-parallel rank's heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5, sliding_window)

    def forward(self, rope: Rope, x, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        heads = self.num_heads + self.num_kv_heads
        # q's heads then k's lie side by side: one rotation turns both
        qk = apply_rotary(qkv[:, :heads * self.head_dim].view(-1, heads, self.head_dim), *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, heads * self.head_dim:].view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, meta).flatten(1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, self_attn: LlamaAttention, norm_class: type[RMSNorm]):
        super().__init__()
        self.input_layernorm = norm_class(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = norm_class(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            getattr(config, "mlp_bias", False))

    def forward(self, rope: Rope, x, residual, meta: AttentionMetadata):
        """(this layer's MLP output, the residual stream before it): the next norm adds the two,
        so each add happens inside a fused norm (residual None: x is the embeddings)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(rope, x, meta), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    norm_class = RMSNorm

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.rotary_emb = RotaryEmbedding(config, head_dim(config), max_positions)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.attention(config, i), self.norm_class)
            for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)

    def attention(self, config, layer_index: int) -> LlamaAttention:
        bias = getattr(config, "attention_bias", False)
        return LlamaAttention(config, getattr(config, "sliding_window", None), bias, bias)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        rope = self.rotary_emb.cos_sin(positions, meta, x.dtype)  # once for every layer
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    decoder_class = LlamaModel
    # Fused projections, loaded by concatenating the checkpoint's separate ones.
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                      "gate_up_proj": ("gate_proj", "up_proj")}
    ignored_checkpoint_tensors = r".*rotary_emb\.inv_freq"
