"""Fused query/key/value projections laid out head by head, as GPT-NeoX and GPT-BigCode store them."""
import torch


def split_per_head_qkv(qkv: torch.Tensor, num_heads: int, head_dim: int):
    """[T, H * 3D] ordered (q_h, k_h, v_h) for each head h -> q, k, v, each [T, H, D]."""
    return qkv.view(-1, num_heads, 3 * head_dim).split(head_dim, dim=-1)
