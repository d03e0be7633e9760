"""Fused matmuls on weight-only quantized storage (quantization.py), chosen once per layer:
- CPU with our kernels built (AVX2 + FMA or AVX512), float32 or bfloat16 inputs: our kernel
  (csrc/quantized_matmul.cpp) on a copy packed as cpu_gemm packs bf16 weights, for int8 with a
  scale per output row, and int8 or 4 bits in groups of any even size (the last may be shorter;
  act-order columns sorted by group once, each input permuted alike). On 2 Zen 1 cores it ran
  SmolLM2's int8 matmul shapes 6-12x faster than torch's int8 kernel with float32 inputs,
  1.3-1.5x with bfloat16 ones. With `int8_inputs`, decode-sized inputs are quantized to int8
  per row and group and multiplied with integer dot products (w4a8, w8a8); bfloat16 batches and
  prompts may multiply each block dequantized to bfloat16 (AMX tiles or AVX512-BF16 dot
  products). quantized_paths chooses by rows and CPU;
- CPU otherwise: torch's int4 kernel (groups of 32-256, output rows a multiple of 16) or int8
  kernel (a scale per row), on the storage or a copy in its layout;
- CUDA with OpenAI Triton installed: our Triton kernel (triton_quant_matmul.py), any layout.
Any other layout dequantizes the weight for each matmul (`QuantizedWeight.forward`)."""
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tritonlm.layers import (cpu_kernels, huge_pages, quantized_packing, quantized_paths,
                             triton_quant_matmul, triton_support)

INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_ROW_MULTIPLE = 16  # its packed layout holds output rows in tiles of 16
INT4_OFFSET = 8  # torch's int4 kernel computes w = (q - 8) * scale + zero
# The groups int8 weights with a scale per row take for int8 inputs: x's scales follow its
# values over 128 features, not the whole row.
ROW_GROUP_SIZE = 128
# x [..., in], bias [out] or None -> x @ W^T + bias [..., out]
Matmul = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def cpu_matmul(qweight: torch.Tensor, values: Callable[[], torch.Tensor], scales: torch.Tensor,
               biases: torch.Tensor | None, g_idx: torch.Tensor, dtype: torch.dtype,
               int8_inputs: bool = False, gated: bool = False) -> Matmul | None:
    """A fused CPU matmul for inputs of `dtype`, or None when torch has none for this layout;
    `values()` gives the integer weight [out, in] unpacked. An `Int4Groups` holds its own copy
    of the weight: the storage it was made from can go. `int8_inputs`: our kernel
    quantizes decode-sized inputs to int8; `gated`: the weight is [gate; up], which our kernel
    packs so that it can apply act(gate) * up itself (PairBlocks)."""
    if qweight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    scales, biases, g_idx = _present_groups(scales, biases, g_idx)
    group_size = _group_size(g_idx, scales.shape[1])
    kernels = cpu_kernels.load()
    if (kernels is not None and kernels.has_bf16_matmul and dtype != torch.float16
            and group_size is not None and (scales.shape[1] == 1 or group_size % 2 == 0)):
        bits = 4 if qweight.dtype == torch.uint8 else 8
        return PairBlocks(values(), scales, biases, g_idx, group_size, kernels, gated=gated,
                          int8_rows=quantized_paths.int8_rows(kernels, bits) if int8_inputs else 0)
    if qweight.dtype == torch.int8:
        if scales.shape[1] != 1 or biases is not None:
            return None
        return _Int8Rows(qweight, scales[:, 0].to(dtype))
    if group_size not in INT4_GROUP_SIZES or qweight.shape[0] % INT4_ROW_MULTIPLE:
        return None
    return Int4Groups(values(), scales, biases, g_idx, group_size, dtype)


def cuda_matmul(qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None,
                g_idx: torch.Tensor) -> Matmul | None:
    if qweight.device.type != "cuda" or not triton_support.available(qweight.device):
        return None
    return lambda x, bias=None: _plus(
        triton_quant_matmul.quantized_matmul(x, qweight, scales, biases, g_idx), bias)


def _plus(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias


def _present_groups(scales: torch.Tensor, biases: torch.Tensor | None, g_idx: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The groups that have columns here, renumbered: a tensor-parallel shard of the input
    columns keeps the global groups' scales, some of which it has no column of."""
    present = torch.bincount(g_idx.long(), minlength=scales.shape[1]) > 0
    if bool(present.all()):
        return scales, biases, g_idx
    renumbered = (torch.cumsum(present, 0) - 1)[g_idx.long()].to(g_idx.dtype)
    return scales[:, present], None if biases is None else biases[:, present], renumbered


def _group_size(g_idx: torch.Tensor, num_groups: int) -> int | None:
    """The size of every group but the last, which may be shorter (columns in any order)."""
    counts = torch.bincount(g_idx.long(), minlength=num_groups)
    size = int(counts[0])
    return size if bool((counts[:-1] == size).all()) and int(counts[-1]) <= size else None


class _Int8Rows(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.qweight, self.scales = qweight.data, scales  # .data: not a second parameter

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        return _plus(out.view(*x.shape[:-1], -1), bias)


class PairBlocks(nn.Module):
    """int8 or 4-bit values (`values` [out, in], 4 bits in 0..15) packed for our kernel: pairs of
    input features per block of 32 output features, as cpu_gemm packs bf16 weights (4 bits: a
    pair in one byte, or where the kernels take them, two pairs of 32 features in 64 bytes,
    `quantized_packing`). Dequantized by one scale per output row (int8, no biases: applied to the
    sums), else by a scale and a bias per output row and group, packed alike [blocks, G, 2, 32].
    Inputs of fewer than `int8_rows` rows are quantized to int8 (int8 rows then take groups of
    ROW_GROUP_SIZE, each with the row's scale, that their input is scaled by). A `gated` weight
    ([gate; up]) is packed as cpu_gemm packs gated bf16 weights: the kernel can then apply
    act(gate) * up to bfloat16 inputs' sums (`forward`'s activation)."""
    owns_weight = True  # a packed copy: the storage it was made from can go

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None,
                 g_idx: torch.Tensor, group_size: int, kernels, sgemm_rows: int | None = None,
                 int8_rows: int = 0, gated: bool = False):
        super().__init__()
        self.out_features, self.kernels, self.int8_rows = values.shape[0], kernels, int8_rows
        self.gated = gated
        bits = 4 if values.dtype == torch.uint8 else 8
        # prompts multiplied as bfloat16 weights, each block dequantized (bfloat16 inputs)
        self.bf16_rows, self.amx = quantized_paths.dequantized_bf16_rows(kernels, bits)
        # prompts: the weight dequantized once and run by float32 sgemm, where that is faster
        # than the kernel's tiles
        self.sgemm_rows = (quantized_paths.sgemm_rows_for_this_cpu(kernels) if sgemm_rows is None
                           else sgemm_rows)
        self.order, values = _sorted_by_group(values, g_idx)
        self.group_size = group_size
        per_row = bits == 8 and scales.shape[1] == 1 and biases is None
        self.register_buffer("packed", huge_pages.place(
            quantized_packing.packed_values(values, gated, kernels)))
        for name in ("row_scales", "groups", "row_groups"):
            self.register_buffer(name, None)
        if per_row:
            self.row_scales = scales[:, 0].float().contiguous()
            if int8_rows:  # int8 inputs are scaled per group: the row's scale in each
                num_groups = -(-values.shape[1] // ROW_GROUP_SIZE)
                self.row_groups = huge_pages.place(
                    quantized_packing.packed_groups(scales.expand(-1, num_groups), None, gated))
        else:
            self.groups = huge_pages.place(quantized_packing.packed_groups(scales, biases, gated))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                activation: int | None = None) -> torch.Tensor:
        """x @ weight.T + bias; with an `activation` code (a gated weight, bfloat16 x):
        act(gate) * up."""
        flat = x.reshape(-1, x.shape[-1])
        if self.order is not None:
            flat = flat.index_select(1, self.order)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        row_scales, groups, group_size = self.row_scales, self.groups, self.group_size
        if self.row_groups is not None and flat.shape[0] < self.int8_rows:
            row_scales, groups, group_size = None, self.row_groups, ROW_GROUP_SIZE
        if bias is not None:
            bias = bias.to(x.dtype).contiguous()
        out = self.kernels.quantized_matmul(
            flat, self.packed, row_scales, groups, group_size, self.out_features, self.gated,
            bias, -1 if activation is None else activation, self.sgemm_rows, self.int8_rows,
            self.bf16_rows, self.amx)
        return out.view(*x.shape[:-1], -1)


def _sorted_by_group(values: torch.Tensor, g_idx: torch.Tensor
                     ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The column order that makes each group a consecutive run (None: already), and the values
    in that order."""
    order = torch.argsort(g_idx, stable=True)
    if torch.equal(order, torch.arange(len(order))):
        return None, values
    return order, values[:, order]


class Int4Groups(nn.Module):
    owns_weight = True  # its packed copy: the storage it was made from can go

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None,
                 g_idx: torch.Tensor, group_size: int, dtype: torch.dtype):
        super().__init__()
        self.order, values = _sorted_by_group(values.to(torch.int32), g_idx)
        self.padding = scales.shape[1] * group_size - values.shape[1]
        values = F.pad(values, (0, self.padding))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            values.contiguous(), 1))
        zeros = scales * INT4_OFFSET + (biases if biases is not None else 0)
        self.register_buffer("scales_and_zeros",
                             torch.stack((scales.T, zeros.T), dim=-1).to(dtype).contiguous())
        self.group_size = group_size

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.order is not None:
            flat = flat.index_select(1, self.order)
        if self.padding:
            flat = F.pad(flat, (0, self.padding))
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.packed,
                                                         self.group_size, self.scales_and_zeros)
        return _plus(out.view(*x.shape[:-1], -1), bias)
