"""Weight-only quantized storage for linear layers: int8 or packed int4 values with per-group
float scales and optional biases (w = q * scale + bias), and the group of every input column
(`g_idx`, so act-order GPTQ needs no reordering). A layer multiplies with a fused kernel where
one takes its layout (quantized_matmul.py), else dequantizes its weight for each matmul; the
full-precision model never exists in memory. Round-to-nearest int8 and int4 quantizers make this
storage from a float weight (tritonlm-convert --quantize, a draft's shortlist head).

Layouts (all row-major over output features):
- `qweight`: int8 [out, in] (8 bits) or uint8 [out, in / 2] (4 bits; column 2j in the low nibble).
- `scales`, `biases`: float32 [out, groups]; no `biases` means symmetric.
- `g_idx`: int32 [in], the group of each input column.
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tritonlm.layers import quantized_matmul

QUANTIZED = "quantized"  # the submodule name under a linear layer that holds its quantized weight
_UNKNOWN = object()  # not settled yet: group size and fused kernel are chosen once loaded


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] values in 0..15 -> uint8 [out, in / 2]."""
    values = values.to(torch.uint8)
    return values[:, 0::2] | (values[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def integer_values(qweight: torch.Tensor) -> torch.Tensor:
    """The integer weight [out, in] of int8 or packed int4 storage."""
    return unpack_int4(qweight) if qweight.dtype == torch.uint8 else qweight


def half_precision(params: torch.Tensor) -> torch.Tensor:
    """Scales or biases rounded to float16 precision (kept in float32), where all of them fit:
    the CPU kernel then reads them at half the bytes (layers/quantized_matmul.py), as GGUF
    stores its own; the values are quantized against the rounded parameters."""
    rounded = params.half()
    return rounded.float() if bool(torch.isfinite(rounded).all()) else params


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric per output channel: q = round(w / s) in -127..127, s = max |w| / 127 (in float16
    precision)."""
    weight = weight.float()
    scales = half_precision(weight.abs().amax(dim=1, keepdim=True) / 127)
    q = torch.round(weight / torch.where(scales > 0, scales, 1)).clamp(-127, 127)
    return {"qweight": q.to(torch.int8), "scales": scales,
            "g_idx": torch.zeros(weight.shape[1], dtype=torch.int32)}


def quantize_int4(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Asymmetric per group of `group_size` consecutive input columns (the last group shorter when
    it does not divide the width): w ~ q * s + min, q in 0..15, s = (max - min) / 15 (s and min
    in float16 precision)."""
    weight = weight.float()
    out_features, in_features = weight.shape
    g_idx = torch.arange(in_features) // group_size
    columns = g_idx.expand(out_features, -1)
    empty = torch.zeros(out_features, int(g_idx[-1]) + 1)
    low = empty.scatter_reduce(1, columns, weight, "amin", include_self=False)
    high = empty.scatter_reduce(1, columns, weight, "amax", include_self=False)
    scales, low = half_precision((high - low) / 15), half_precision(low)
    q = torch.round((weight - low[:, g_idx]) / torch.where(scales > 0, scales, 1)[:, g_idx]).clamp(0, 15)
    return {"qweight": pack_int4(q), "scales": scales, "biases": low, "g_idx": g_idx.to(torch.int32)}


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None,
               g_idx: torch.Tensor, dtype: torch.dtype, group_size: int | None = None) -> torch.Tensor:
    """The float weight. `group_size`, when the groups are consecutive runs of that many columns,
    lets the scales broadcast over a [out, groups, size] view instead of a per-column gather."""
    values = integer_values(qweight).to(torch.float32)
    if group_size is not None:
        rows, num_groups = scales.shape
        grouped = values.view(rows, num_groups, group_size)
        weight = grouped * scales[..., None]
        if biases is not None:
            weight += biases[..., None]
        return weight.view(rows, -1).to(dtype)
    groups = g_idx.long()
    weight = values * scales[:, groups]
    if biases is not None:
        weight += biases[:, groups]
    return weight.to(dtype)


def uniform_group_size(g_idx: torch.Tensor, num_groups: int) -> int | None:
    """The size of the groups if they are equal consecutive runs of columns (no act-order)."""
    columns = g_idx.shape[0]
    if columns % num_groups:
        return None
    size = columns // num_groups
    expected = torch.arange(columns, device=g_idx.device) // size
    return size if torch.equal(g_idx.long(), expected) else None


class QuantizedWeight(nn.Module):
    """The quantized weight of one (parallel) linear layer; `shard` is that layer's
    (dim, indices) of the full weight, so the storage is cut consistently. The model runner
    sets `int8_inputs` before the first matmul (EngineConfig.quantized_activations); a weight
    whose rows are looked up (`keeps_rows`: a quantized embedding) stays beside a fused matmul's
    own layout. A `gated` weight ([gate; up] of a gated MLP) lets a fused kernel apply
    act(gate) * up (`act_and_mul`)."""
    int8_inputs = False
    keeps_rows = False
    rows_dtype = torch.float32  # what `rows` decodes to: the loader sets the model's dtype

    def __init__(self, out_features: int, in_features: int, bits: int, num_groups: int,
                 has_biases: bool, shard: tuple[int, np.ndarray] | None, gated: bool = False):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"quantized weights have 4 or 8 bits, not {bits}")
        self.shard, self.gated = shard, gated
        packed_in = in_features // 2 if bits == 4 else in_features
        dtype = torch.uint8 if bits == 4 else torch.int8
        self.qweight = nn.Parameter(torch.empty(out_features, packed_in, dtype=dtype),
                                    requires_grad=False)
        self.scales = nn.Parameter(torch.empty(out_features, num_groups), requires_grad=False)
        self.biases = (nn.Parameter(torch.empty(out_features, num_groups), requires_grad=False)
                       if has_biases else None)
        self.g_idx = nn.Parameter(torch.empty(in_features, dtype=torch.int32), requires_grad=False)
        self.group_size = _UNKNOWN
        self.fused = _UNKNOWN

    def forward(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight."""
        return dequantize(self.qweight, self.scales, self.biases, self.g_idx, dtype,
                          self._settled_group_size())

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fused is _UNKNOWN:  # chosen on first use, once the weights are loaded
            self._choose_fused(x.dtype)
        if self.fused is None:
            return F.linear(x, self(x.dtype), bias)
        return self.fused(x, bias)

    def act_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None, activation: int
                    ) -> torch.Tensor | None:
        """act(gate) * up of (x @ weight.T + bias) in the fused kernel (`activation` a fused
        code, layers.activation.FUSED_CODES), or None where it cannot (bfloat16 x on our CPU
        kernel only)."""
        if self.fused is _UNKNOWN:
            self._choose_fused(x.dtype)
        if not getattr(self.fused, "gated", False) or x.dtype != torch.bfloat16:
            return None
        return self.fused(x, bias, activation)

    def _choose_fused(self, dtype: torch.dtype) -> None:
        args = (self.qweight, self.scales, self.biases, self.g_idx)
        self.fused = (quantized_matmul.cuda_matmul(*args)
                      or quantized_matmul.cpu_matmul(self.qweight, self.values, *args[1:], dtype,
                                                     self.int8_inputs, self.gated))
        if getattr(self.fused, "owns_weight", False) and not self.keeps_rows:
            empty = torch.empty(0)
            self.qweight, self.scales = nn.Parameter(empty.to(torch.uint8), False), None
            self.biases = None

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The dequantized rows `index` (any shape) -> [*index.shape, in_features]."""
        flat = index.reshape(-1)
        biases = None if self.biases is None else self.biases[flat]
        weight = dequantize(self.qweight[flat], self.scales[flat], biases, self.g_idx, self.rows_dtype,
                            self._settled_group_size())
        return weight.view(*index.shape, -1)

    def _settled_group_size(self) -> int | None:
        if self.group_size is _UNKNOWN:  # settled once the weights are loaded
            self.group_size = uniform_group_size(self.g_idx, self.scales.shape[1])
        return self.group_size

    def values(self) -> torch.Tensor:
        return integer_values(self.qweight)

    def shard_parts(self, leaf: str, part_sizes: list[int]) -> list[tuple[int, np.ndarray] | None]:
        """This rank's cut of each checkpoint part (parts of a fused layer stack on dim 0;
        they share their input columns, so `g_idx` comes from the first part alone)."""
        if self.shard is None:
            return [None] * len(part_sizes)
        dim, index = self.shard
        if dim == 0:  # output rows: every per-row tensor; g_idx is per input column
            return [None] if leaf == "g_idx" else rows_of_parts(index, part_sizes)
        if leaf in ("scales", "biases"):  # input columns: groups keep their global numbering
            return [None] * len(part_sizes)
        if leaf == "qweight" and self.qweight.dtype == torch.uint8:
            return [(1, index[0::2] // 2)] * len(part_sizes)
        return [(1 if leaf == "qweight" else 0, index)] * len(part_sizes)


def rows_of_parts(index: np.ndarray, part_sizes: list[int]) -> list[tuple[int, np.ndarray]]:
    """Split a layer's row indices over the checkpoint parts stacked on dim 0."""
    offsets = np.cumsum([0] + part_sizes)
    return [(0, index[(index >= start) & (index < end)] - start)
            for start, end in zip(offsets[:-1], offsets[1:])]
