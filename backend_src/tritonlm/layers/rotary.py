"""Rotary position embeddings (neox rotate-half) with Hugging Face's frequency schemes.

Position-pure schemes read a cos/sin table precomputed up to the context limit. Dynamic NTK
depends on how long the sequence is in this step, so its frequencies are computed per token.
"""
import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tritonlm.layers import fused_ops
from tritonlm.layers.attention_metadata import AttentionMetadata

Rope = tuple[torch.Tensor, torch.Tensor]  # a step's per-token cos and sin, [T, 1, rotary_dim]


def _rope_parameters(config) -> dict:
    return getattr(config, "rope_parameters", None) or {}


def _inverse_frequencies(config, rotary_dim: int) -> tuple[torch.Tensor, float]:
    rope = _rope_parameters(config)
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim
        return 1.0 / (base ** exponents), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    return ROPE_INIT_FUNCTIONS[rope_type](config)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first rotary_dim features of x [T, H, D]; cos and sin: [T, 1, rotary_dim].
    The fused kernel (C++ on CPU, Triton on CUDA) rotates x in place (and returns it)."""
    kernels = fused_ops.for_tensor(x)
    if kernels is not None and x.stride(-1) == 1 and cos.dtype == x.dtype:
        kernels.rotary_(x, cos.squeeze(1), sin.squeeze(1))
        return x
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class RotaryEmbedding(nn.Module):
    """The cos and sin `apply_rotary` turns the first `rotary_dim` features of each head by."""

    def __init__(self, config, rotary_dim: int, max_positions: int):
        super().__init__()
        self.rotary_dim = rotary_dim
        rope = _rope_parameters(config)
        self.dynamic = rope.get("rope_type") == "dynamic"
        if self.dynamic:
            self.base, self.factor = rope["rope_theta"], rope["factor"]
            self.original_length = config.max_position_embeddings  # HF scales past this one
            return
        with torch.device("cpu"):  # real tables even when the model is built on the meta device
            inv_freq, scaling = _inverse_frequencies(config, rotary_dim)
            freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype) -> Rope:
        """This step's per-token cos and sin, computed once for every layer; dynamic NTK reads
        each token's sequence length from `meta`."""
        if self.dynamic:
            freqs = positions[:, None].float() * self._dynamic_inverse_frequencies(meta.seq_lens)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        else:
            cos, sin = self.cos[positions], self.sin[positions]
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def _dynamic_inverse_frequencies(self, lengths: torch.Tensor) -> torch.Tensor:
        """[T, rotary_dim / 2]: HF's `_compute_dynamic_ntk_parameters` at each token's length.

        HF recomputes the frequencies once per forward from the whole batch's longest sequence and
        keeps them while a request grows; per token and per sequence this equals HF serving one
        request at a time. The keys keep the frequencies of the step that wrote them, so a prompt
        split by chunked prefill, recomputed after preemption or partly reused from the prefix
        cache was rotated with other lengths than HF's single prefill uses.
        """
        dim = self.rotary_dim
        length = torch.clamp(lengths, min=self.original_length)
        base = self.base * ((self.factor * length / self.original_length)
                            - (self.factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=lengths.device).float() / dim
        return 1.0 / (base[:, None] ** exponents[None, :])
