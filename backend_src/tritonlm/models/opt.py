"""OPT family: OPT (pre- and post-layer-norm, projected embeddings), Galactica."""
import torch
from torch import nn

from tritonlm.layers.activation import activation
from tritonlm.layers.attention import PagedAttention
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.causal_lm_head import CausalLM
from tritonlm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

# OPT's position table keeps two leading rows unused: position p is row p + 2.
POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, heads, heads, self.head_dim, config.enable_bias)
        self.out_proj = RowParallelLinear(hidden, hidden, config.enable_bias)
        self.num_heads = self.qkv_proj.num_heads  # this tensor-parallel rank's
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, x, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        return self.out_proj(self.attn(q, k, v, meta).flatten(1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, affine = config.hidden_size, config.layer_norm_elementwise_affine
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(hidden, config.ffn_dim, config.enable_bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, config.enable_bias)
        self.act = activation(config.activation_function)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)

    def forward(self, x, meta: AttentionMetadata) -> torch.Tensor:
        x = self._residual(x, self.self_attn_layer_norm, lambda h: self.self_attn(h, meta))
        return self._residual(x, self.final_layer_norm, lambda h: self.fc2(self.act(self.fc1(h))))

    def _residual(self, x, norm: nn.LayerNorm, sublayer) -> torch.Tensor:
        """Pre-norm (most sizes) or post-norm (opt-350m) around a residual sublayer."""
        if self.do_layer_norm_before:
            return x + sublayer(norm(x))
        return norm(x + sublayer(x))


class OPTDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, embed_dim = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, embed_dim)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, hidden)
        projected = embed_dim != hidden
        self.project_in = nn.Linear(embed_dim, hidden, bias=False) if projected else None
        self.project_out = nn.Linear(hidden, embed_dim, bias=False) if projected else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))
        # Post-norm models (and pre-v4.20 fine-tunes flagged `_remove_final_layer_norm`) have none.
        self.final_layer_norm = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=config.layer_norm_elementwise_affine)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return x if self.project_out is None else self.project_out(x)


class OPTModel(nn.Module):
    """HF's `model.decoder` nesting."""

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.decoder = OPTDecoder(config)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.decoder(input_ids, positions, meta)


class OPTForCausalLM(CausalLM):
    decoder_class = OPTModel
    embedding_name = "decoder.embed_tokens"
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
