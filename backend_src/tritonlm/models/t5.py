"""T5 / FLAN-T5: an encoder run once per request, and a decoder whose self-attention uses the paged
cache and whose cross-attention reads the encoder's K/V, written once into the request's cross blocks.
Tensor-parallel by heads, the relative position biases included."""
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tritonlm.distributed import parallel_state
from tritonlm.layers.attention import PagedAttention
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.linear import ColumnParallelLinear, RowParallelLinear, local_head_range
from tritonlm.layers.mlp import MLP, GatedMLP
from tritonlm.layers.norm import RMSNorm


def local_heads(config) -> range:
    tp = parallel_state.current()
    return local_head_range(config.num_heads, tp.rank, tp.world_size)


class RelativeAttentionBias(nn.Embedding):
    """Each relative position bucket's bias for every head, [buckets, heads]: a rank holds the
    columns of its own heads."""

    def __init__(self, config):
        self.head_index = np.array(local_heads(config))
        super().__init__(config.relative_attention_num_buckets, len(self.head_index))

    def shard_parts(self, leaf: str, part_sizes: list[int]) -> list[tuple[int, np.ndarray]]:
        return [(1, self.head_index)]


class T5Attention(nn.Module):
    """q/k/v/o without biases or score scaling; the first layer of a stack owns the relative
    position buckets' biases, which every layer of the stack adds."""

    def __init__(self, config, has_relative_bias: bool, bidirectional: bool):
        super().__init__()
        self.num_heads, self.head_dim = len(local_heads(config)), config.d_kv
        inner = config.num_heads * self.head_dim
        self.q = ColumnParallelLinear(config.d_model, inner, bias=False)
        self.k = ColumnParallelLinear(config.d_model, inner, bias=False)
        self.v = ColumnParallelLinear(config.d_model, inner, bias=False)
        self.o = RowParallelLinear(inner, config.d_model, bias=False)
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.bidirectional = bidirectional
        if has_relative_bias:
            self.relative_attention_bias = RelativeAttentionBias(config)

    def heads(self, projection: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return projection(x).unflatten(-1, (self.num_heads, self.head_dim))

    def relative_bias(self, distance: torch.Tensor) -> torch.Tensor:
        """distance [..., L] (key minus query position) -> biases [..., H, L]."""
        return self.relative_attention_bias(self._bucket(distance)).transpose(-1, -2)

    def _bucket(self, distance: torch.Tensor) -> torch.Tensor:
        num_buckets, buckets = self.num_buckets, torch.zeros_like(distance)
        if self.bidirectional:
            num_buckets //= 2
            buckets += (distance > 0).long() * num_buckets
            distance = distance.abs()
        else:
            distance = (-distance).clamp(min=0)
        max_exact = num_buckets // 2
        large = max_exact + (torch.log(distance.float() / max_exact)
                             / math.log(self.max_distance / max_exact)
                             * (num_buckets - max_exact)).long()
        large = large.clamp(max=num_buckets - 1)
        return buckets + torch.where(distance < max_exact, distance, large)


class T5Sublayer(nn.Module):
    """HF's T5Layer{SelfAttention,CrossAttention,FF}: a pre-norm residual branch."""

    def __init__(self, config, inner: nn.Module, name: str):
        super().__init__()
        self.name = name
        self.add_module(name, inner)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    @property
    def inner(self) -> nn.Module:
        return getattr(self, self.name)


def _feed_forward(config) -> nn.Module:
    if config.is_gated_act:
        return GatedMLP(config.d_model, config.d_ff, config.dense_act_fn, bias=False)
    return MLP(config.d_model, config.d_ff, config.dense_act_fn, bias=False, names=("wi", "wo"))


class T5EncoderBlock(nn.Module):
    def __init__(self, config, first: bool):
        super().__init__()
        self.layer = nn.ModuleList([
            T5Sublayer(config, T5Attention(config, first, bidirectional=True), "SelfAttention"),
            T5Sublayer(config, _feed_forward(config), "DenseReluDense")])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: [B, S, d_model]; mask: [B, H, S, S] additive (position biases, -inf on padding)."""
        attention, ff = self.layer
        h = attention.layer_norm(x)
        q, k, v = (attention.inner.heads(p, h).transpose(1, 2)
                   for p in (attention.inner.q, attention.inner.k, attention.inner.v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        x = x + attention.inner.o(o.transpose(1, 2).flatten(2))
        return x + ff.inner(ff.layer_norm(x))


class T5DecoderBlock(nn.Module):
    def __init__(self, config, index: int, relative_bias):
        super().__init__()
        self_attention = T5Attention(config, index == 0, bidirectional=False)
        cross_attention = T5Attention(config, False, bidirectional=False)
        self.layer = nn.ModuleList([
            T5Sublayer(config, self_attention, "SelfAttention"),
            T5Sublayer(config, cross_attention, "EncDecAttention"),
            T5Sublayer(config, _feed_forward(config), "DenseReluDense")])
        heads, dim = self_attention.num_heads, config.d_kv
        # The bias is a bound method of layer 0's attention: shared, not a submodule of each layer.
        self.self_attn = PagedAttention(heads, heads, dim, 1.0, position_bias=relative_bias
                                        or self_attention.relative_bias, kv_slot=index)
        self.cross_attn = PagedAttention(heads, heads, dim, 1.0, causal=False, kv_slot=index)

    def write_cross_kv(self, encoded: torch.Tensor, rows: torch.Tensor) -> None:
        cross = self.layer[1].inner
        self.cross_attn.write(cross.heads(cross.k, encoded), cross.heads(cross.v, encoded), rows)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self_sub, cross_sub, ff = self.layer
        attention, h = self_sub.inner, self_sub.layer_norm(x)
        out = self.self_attn(attention.heads(attention.q, h), attention.heads(attention.k, h),
                             attention.heads(attention.v, h), meta)
        x = x + attention.o(out.flatten(1))
        cross, h = cross_sub.inner, cross_sub.layer_norm(x)
        x = x + cross.o(self.cross_attn.attend(cross.heads(cross.q, h), meta.cross).flatten(1))
        return x + ff.inner(ff.layer_norm(x))


class T5Stack(nn.Module):
    def __init__(self, config, blocks: list[nn.Module]):
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.final_layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)


class T5ForConditionalGeneration(nn.Module):
    packed_modules = {"gate_up_proj": ("wi_0", "wi_1"), "down_proj": ("wo",)}
    ignored_checkpoint_tensors = r"(encoder|decoder)\.embed_tokens\.weight"

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, [T5EncoderBlock(config, i == 0)
                                        for i in range(config.num_layers)])
        first = T5DecoderBlock(config, 0, None)
        self.decoder = T5Stack(config, [first] + [
            T5DecoderBlock(config, i, first.layer[0].inner.relative_bias)
            for i in range(1, config.num_decoder_layers)])
        self.tie_word_embeddings = config.tie_word_embeddings
        self.output_scale = config.d_model ** -0.5 if getattr(
            config, "scale_decoder_outputs", config.tie_word_embeddings) else 1.0
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def encode(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Padded prompts [B, S] -> encoder output of the valid tokens [N, d_model]."""
        x = self.shared(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        bias = self.encoder.block[0].layer[0].inner.relative_bias(
            positions[None, :] - positions[:, None])  # [S, H, S]
        mask = bias.transpose(0, 1)[None].masked_fill(~valid[:, None, None, :], float("-inf"))
        for block in self.encoder.block:
            x = block(x, mask.to(x.dtype))
        return self.encoder.final_layer_norm(x)[valid]

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        if meta.encoder is not None:
            encoded = self.encode(meta.encoder.input_ids, meta.encoder.valid)
            for block in self.decoder.block:
                block.write_cross_kv(encoded, meta.encoder.write_rows)
        x = self.shared(input_ids)
        for block in self.decoder.block:
            x = block(x, meta)
        return self.decoder.final_layer_norm(x) * self.output_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.shared.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight)
