"""Fused query/key/value projections laid out kv group by kv group, each group holding its
queries, then its key, then its value: [groups, queries_per_group + 2, head_dim].

Every fused layout the families store is this one: per head (groups = heads: GPT-NeoX, BLOOM,
multi-head GPT-BigCode, Falcon RW), multi-query (one group: Falcon 7B, GPT-BigCode) and Falcon
40B's grouped kv heads. A tensor-parallel rank's slice keeps the layout: its groups, each with
the rank's queries of that group (QKVParallelLinear(grouped=True))."""
import torch


def split_grouped_qkv(qkv: torch.Tensor, num_groups: int, head_dim: int):
    """[T, groups * (per_group + 2) * D] -> q [T, groups * per_group, D], k, v [T, groups, D]."""
    grouped = qkv.view(qkv.shape[0], num_groups, -1, head_dim)
    return grouped[:, :, :-2].flatten(1, 2), grouped[:, :, -2], grouped[:, :, -1]
