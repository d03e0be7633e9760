"""Tensor-parallel linear layers (Megatron style). Each is built for the current rank
(distributed.parallel_state) and knows which slice of the full weight it holds, so the converter
and the loader shard checkpoints with the layer's own `shard_index` and no per-model code.

- Column-parallel: output features split; each rank computes its own slice (no communication).
- Row-parallel: input features split; partial outputs are summed over ranks, then the (replicated)
  bias is added once.
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tritonlm.distributed import parallel_state
from tritonlm.layers import cpu_gemm
from tritonlm.layers.lora import LayerLoRA
from tritonlm.layers.quantization import QUANTIZED, QuantizedWeight, rows_of_parts


def even_split(size: int, rank: int, world_size: int) -> np.ndarray:
    if size % world_size:
        raise ValueError(f"{size} features do not split evenly over {world_size} ranks")
    part = size // world_size
    return np.arange(rank * part, (rank + 1) * part)


def local_head_range(num_heads: int, rank: int, world_size: int) -> range:
    """The query heads a rank computes; the head count must divide evenly."""
    if num_heads % world_size:
        raise ValueError(f"tensor parallel size {world_size} must divide the {num_heads} heads")
    part = num_heads // world_size
    return range(rank * part, (rank + 1) * part)


def local_kv_heads(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> list[int]:
    """The kv heads a rank's query heads use: a slice, or one replicated head when the ranks
    outnumber the kv heads (multi-query and grouped-query models)."""
    if num_kv_heads % world_size and world_size % num_kv_heads:
        raise ValueError(f"tensor parallel size {world_size} must divide the {num_kv_heads} kv "
                         "heads, or be a multiple of them")
    heads = local_head_range(num_heads, rank, world_size)
    per_kv = num_heads // num_kv_heads
    return list(dict.fromkeys(h // per_kv for h in heads))


class _ShardedLinear(nn.Linear):
    """A Linear holding `shard_index` of the full weight's features along `shard_dim`. The
    loader may swap its weight for quantized storage (`use_quantized_weight`), the model runner
    for a CPU-prepacked one (`prepack_for_cpu`) and give it LoRA slots (`lora`).
    `full_features`: (in, out) of the whole weight; `part_sizes`: the output features of each
    part a fused layer is made of."""
    shard_dim = 0
    packed: cpu_gemm.PackedWeight | None = None
    gated = False  # [gate; up] halves, which a packed weight may turn into act(gate) * up
    lora: LayerLoRA | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, index: np.ndarray):
        self.shard_index = index
        self.full_features = (in_features, out_features)
        self.part_sizes = [out_features]
        local = len(index)
        if self.shard_dim == 0:
            super().__init__(in_features, local, bias=bias)
        else:
            super().__init__(local, out_features, bias=bias)

    def use_quantized_weight(self, bits: int, num_groups: int, has_biases: bool) -> None:
        del self.weight
        self.add_module(QUANTIZED, QuantizedWeight(
            self.out_features, self.in_features, bits, num_groups, has_biases,
            (self.shard_dim, self.shard_index) if parallel_state.current().world_size > 1 else None,
            self.gated))

    def prepack_for_cpu(self, batch_hint: int) -> None:
        """Hold the weight only in a CPU matmul kernel's layout, when that is faster here."""
        if getattr(self, QUANTIZED, None) is None:
            self.packed = cpu_gemm.prepack(self.weight, batch_hint, self.gated)
            if self.packed is not None:
                self.weight = None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        quantized = getattr(self, QUANTIZED, None)
        if quantized is not None:
            return quantized(dtype)
        return self.packed.dense() if self.packed is not None else self.weight

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        quantized = getattr(self, QUANTIZED, None)
        if quantized is not None:
            return quantized.matmul(x, bias)
        if self.packed is not None:
            return self.packed.matmul(x, bias)
        return F.linear(x, self.dense_weight(x.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._with_lora(self.matmul(x, self.bias), x)

    def _with_lora(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y if self.lora is None else self.lora.add_to(y, x)

    @property
    def lora_active(self) -> bool:
        return self.lora is not None and self.lora.active

    def shard_parts(self, leaf: str, part_sizes: list[int]) -> list[tuple[int, np.ndarray] | None]:
        """How to cut this rank's slice from each checkpoint part (concatenated along dim 0) of
        the full `weight` or `bias`: (dim, indices), or None to take a part whole."""
        if leaf == "bias" and self.shard_dim == 1:
            return [None] * len(part_sizes)  # replicated, added once after the reduction
        if self.shard_dim == 1:
            return [(1, self.shard_index)] * len(part_sizes)
        return rows_of_parts(self.shard_index, part_sizes)


class ColumnParallelLinear(_ShardedLinear):
    """Output features split evenly, or as the concatenation of evenly split `segments`
    (fused gate/up projections: `gated`, see `act_and_mul`)."""

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool,
                 gated: bool = False):
        tp = parallel_state.current()
        segments = out_features if isinstance(out_features, list) else [out_features]
        offsets = np.cumsum([0] + segments[:-1])
        index = np.concatenate([offset + even_split(size, tp.rank, tp.world_size)
                                for offset, size in zip(offsets, segments)])
        super().__init__(in_features, sum(segments), bias, index)
        self.part_sizes = segments
        self.gated = gated

    def act_and_mul(self, x: torch.Tensor, activation: int) -> torch.Tensor | None:
        """act(gate) * up of a gated layer in the matmul itself (`activation` a fused code,
        layers.activation.FUSED_CODES), or None where the weight's kernel cannot."""
        if self.lora_active:
            return None
        quantized = getattr(self, QUANTIZED, None)
        if quantized is not None:
            return quantized.act_and_mul(x, self.bias, activation)
        if self.packed is None or not self.packed.gated:
            return None
        return self.packed.matmul(x, self.bias, activation)


class QKVParallelLinear(_ShardedLinear):
    """Fused q/k/v projection split by heads. Layouts: `grouped=False` is [q heads | k heads |
    v heads]; `grouped=True` is per kv group [q heads of the group, k, v] (GPT-NeoX and BLOOM
    with one query per group, Falcon 40B). The local weight keeps the same layout."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, grouped: bool = False):
        tp = parallel_state.current()
        q_heads = list(local_head_range(num_heads, tp.rank, tp.world_size))
        kv_heads = local_kv_heads(num_heads, num_kv_heads, tp.rank, tp.world_size)
        self.num_heads, self.num_kv_heads, self.head_dim = len(q_heads), len(kv_heads), head_dim
        per_kv = num_heads // num_kv_heads
        if grouped:  # rows of kv group g: its per_kv query heads, then k, then v
            stride = per_kv + 2
            heads = [row for g in kv_heads for row in
                     [g * stride + h % per_kv for h in q_heads if h // per_kv == g]
                     + [g * stride + per_kv, g * stride + per_kv + 1]]
        else:
            heads = (q_heads + [num_heads + g for g in kv_heads]
                     + [num_heads + num_kv_heads + g for g in kv_heads])
        index = (np.array(heads)[:, None] * head_dim + np.arange(head_dim)).reshape(-1)
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, index)
        if not grouped:  # q, k, v: separate checkpoint parts where the family saves them so
            self.part_sizes = [num_heads * head_dim] + [num_kv_heads * head_dim] * 2


class ReplicatedLinear(_ShardedLinear):
    """The whole weight on every rank (a quantized LM head)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias, np.arange(out_features))


class RowParallelLinear(_ShardedLinear):
    """Input features split evenly; outputs summed over ranks, then the bias added once."""
    shard_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool):
        tp = parallel_state.current()
        super().__init__(in_features, out_features, bias,
                         even_split(in_features, tp.rank, tp.world_size))
        # The world it was built for: a single-rank draft model runs inside a rank of a
        # tensor-parallel target, and must not sum over that target's ranks.
        self.world_size = tp.world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return super().forward(x)
        out = parallel_state.all_reduce(self._with_lora(self.matmul(x, None), x))
        return out + self.bias if self.bias is not None else out
