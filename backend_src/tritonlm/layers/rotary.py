"""Rotary position embeddings with a cos/sin table precomputed up to the context limit."""
import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Types whose frequencies depend on the batch's current length are not position-pure.
_UNSUPPORTED = {"dynamic"}


def _inverse_frequencies(config, rotary_dim: int) -> tuple[torch.Tensor, float]:
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type in _UNSUPPORTED or (rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS):
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    if rope_type == "default":
        base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim
        return 1.0 / (base ** exponents), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding over the first `rotary_dim` features of a head."""

    def __init__(self, config, rotary_dim: int, max_positions: int):
        super().__init__()
        with torch.device("cpu"):  # real tables even when the model is built on the meta device
            inv_freq, scaling = _inverse_frequencies(config, rotary_dim)
            freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
        self.rotary_dim = rotary_dim
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D]; returns both rotated."""
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
