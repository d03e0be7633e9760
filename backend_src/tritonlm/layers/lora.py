"""LoRA updates inside the parallel linear layers, several adapters in one batch (Punica's idea,
vLLM's multi-LoRA): every layer an adapter targets holds `max_loras` slots of stacked low-rank
weights, and each of a step's tokens uses one slot, or none (the base model). The step's tokens
are grouped by slot (padded to the largest group), so a whole batch's update is one gather, two
batched matmuls and one scatter-add per layer, whatever the mix of adapters:

    xs = x[rows]                           (slots, tokens per slot, in)
    y[rows] += (xs @ A^T[slot]) @ B[slot]  (padding rows add zero)

On CPU csrc/lora.cpp does it in one call, blocks of a slot's tokens sharing each load of its
weights: 1.5-4.5x faster than the batched ops from 32 to 2048 tokens (SmolLM2's layers, rank 16,
4 adapters, bfloat16, 2 Cascade Lake cores).

A fused layer (q/k/v, gate/up) holds its parts' A and B side by side: R = parts * max rank,
and the B rows of one part reach only that part's outputs. Tensor parallel: A is cut like the
layer's input (row-parallel) and B like its output (column-parallel), so each rank's update
joins its partial output before the all-reduce. Weights (alpha / r folded into B) and the update
are float32 whatever the model's dtype: small, and exact against a float32 reference.
"""
from dataclasses import dataclass

import torch

from tritonlm.layers import cpu_kernels


@dataclass
class LoRABatch:
    """This step's tokens by slot, shared by every layer (the model runner sets it); None: no
    adapter in this step."""
    rows: torch.Tensor | None = None  # (slots, M) token indices, padded with 0
    keep: torch.Tensor | None = None  # (slots, M, 1) float32: 1 for a token, 0 for padding
    counts: torch.Tensor | None = None  # (slots,) int64: tokens of each slot


class LayerLoRA:
    """One layer's slots: A^T (slots, in, R) and B (slots, R, out), zero where a slot's adapter
    does not target the layer (or a part of it)."""

    def __init__(self, batch: LoRABatch, num_slots: int, rank_dim: int, in_features: int,
                 out_features: int, part_cols: list[int], device: torch.device):
        """`part_cols`: where each part's outputs start in this rank's output, then its end."""
        self.batch = batch
        self.part_cols = torch.tensor(part_cols, dtype=torch.int64)
        self.a_t = torch.zeros(num_slots, in_features, rank_dim, device=device)
        self.b = torch.zeros(num_slots, rank_dim, out_features, device=device)

    def load(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's (R, in) and (R, out) weights in `slot`; None: it leaves the layer be."""
        if a is None:
            self.a_t[slot].zero_()
            self.b[slot].zero_()
        else:
            self.a_t[slot].copy_(a.T)
            self.b[slot].copy_(b)

    @property
    def active(self) -> bool:
        return self.batch.rows is not None

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        rows = self.batch.rows
        if rows is None:
            return y
        flat_x = x.reshape(-1, x.shape[-1])
        if y.device.type == "cpu":
            kernels = cpu_kernels.for_tensor(y)
            if kernels is not None:
                kernels.lora_add_(y.view(-1, y.shape[-1]), flat_x, self.a_t, self.b,
                                  rows, self.batch.counts, self.part_cols)
                return y
        update = torch.bmm(torch.bmm(flat_x[rows].float(), self.a_t), self.b) * self.batch.keep
        flat_y = y.reshape(-1, y.shape[-1])
        return flat_y.index_add(0, rows.view(-1), update.view(-1, flat_y.shape[-1]).to(y.dtype)
                                ).view(y.shape)
