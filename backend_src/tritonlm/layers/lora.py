"""LoRA updates inside the parallel linear layers, several adapters in one batch (Punica's idea,
vLLM's multi-LoRA): every layer an adapter targets holds `max_loras` slots of stacked low-rank
weights, and each of a step's tokens picks a slot, or none (the base model). The update of the
whole batch is two matmuls per layer, whatever the mix of adapters:

    shrink = x @ A[every slot]^T                 (tokens, slots * R)
    shrink *= one-hot of each token's slot       (zero rows for the base model's tokens)
    y += shrink @ B[every slot]                  (tokens, out)

A fused layer (q/k/v, gate/up) holds its parts' A and B side by side: R = parts * max rank,
and the B rows of one part reach only that part's outputs. Tensor parallel: A is cut like the
layer's input (row-parallel) and B like its output (column-parallel), so each rank's update
joins its partial output before the all-reduce. Weights (alpha / r folded into B) and the update
are float32 whatever the model's dtype: small, and exact against a float32 reference.
"""
from dataclasses import dataclass

import torch


@dataclass
class LoRABatch:
    """This step's choice of slot per token, shared by every layer (the model runner sets it)."""
    mask: torch.Tensor | None = None  # (tokens, slots) one-hot, float32; None: no adapter


class LayerLoRA:
    """One layer's slots: A (slots, R, in) and B (slots, R, out), zero where a slot's adapter
    does not target the layer (or a part of it)."""

    def __init__(self, batch: LoRABatch, num_slots: int, rank_dim: int, in_features: int,
                 out_features: int, device: torch.device):
        self.batch = batch
        self.a = torch.zeros(num_slots, rank_dim, in_features, device=device)
        self.b = torch.zeros(num_slots, rank_dim, out_features, device=device)

    def load(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's (R, in) and (R, out) weights in `slot`; None: it leaves the layer be."""
        if a is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
        else:
            self.a[slot].copy_(a)
            self.b[slot].copy_(b)

    @property
    def active(self) -> bool:
        return self.batch.mask is not None

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        mask = self.batch.mask
        if mask is None:
            return y
        slots, rank_dim = self.a.shape[:2]
        flat = x.reshape(-1, x.shape[-1]).float()
        shrink = (flat @ self.a.view(slots * rank_dim, -1).T).view(-1, slots, rank_dim)
        shrink = (shrink * mask[:, :, None]).view(-1, slots * rank_dim)
        update = shrink @ self.b.view(slots * rank_dim, -1)
        return y + update.view(*y.shape).to(y.dtype)
