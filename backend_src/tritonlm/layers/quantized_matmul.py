"""Fused matmuls on weight-only quantized storage (quantization.py), chosen once per layer:
- CPU, 4 bits in groups of 32, 64, 128 or 256 columns (the last may be shorter), output rows a
  multiple of 16: torch's int4 kernel, on a copy of the weight in its packed layout (act-order
  columns sorted by group once, each input permuted alike; a short last group padded with zero
  inputs);
- CPU, 8 bits with one scale per output row: our kernel (csrc/int8_matmul.cpp, AVX2 or AVX512)
  on a copy packed as cpu_gemm packs bf16 weights, for float32 and bfloat16 inputs; else torch's
  int8 kernel on the storage as it is (on 2 Zen 1 cores ours ran SmolLM2's matmul shapes
  6-12x faster than torch's with float32 inputs, 1.3-1.5x with bfloat16 ones);
- CUDA with OpenAI Triton installed: our Triton kernel (triton_quant_matmul.py), any layout.
Any other layout dequantizes the weight for each matmul (`QuantizedWeight.forward`)."""
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tritonlm.layers import cpu_gemm, cpu_kernels, triton_quant_matmul, triton_support

INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_ROW_MULTIPLE = 16  # its packed layout holds output rows in tiles of 16
INT4_OFFSET = 8  # torch's int4 kernel computes w = (q - 8) * scale + zero
Matmul = Callable[[torch.Tensor], torch.Tensor]  # x [..., in] -> x @ W^T [..., out]


def cpu_matmul(qweight: torch.Tensor, values: Callable[[], torch.Tensor], scales: torch.Tensor,
               biases: torch.Tensor | None, g_idx: torch.Tensor, dtype: torch.dtype
               ) -> Matmul | None:
    """A fused CPU matmul for inputs of `dtype`, or None when torch has none for this layout;
    `values()` gives the integer weight [out, in] unpacked. An `Int4Groups` holds its own copy
    of the weight: the storage it was made from can go."""
    if qweight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if qweight.dtype == torch.int8:
        if scales.shape[1] != 1 or biases is not None:
            return None
        kernels = cpu_kernels.load()
        if kernels is not None and kernels.has_bf16_matmul and dtype != torch.float16:
            return Int8PairBlocks(qweight, scales[:, 0], kernels)
        return _Int8Rows(qweight, scales[:, 0].to(dtype))
    group_size = _group_size(g_idx, scales.shape[1])
    if group_size not in INT4_GROUP_SIZES or qweight.shape[0] % INT4_ROW_MULTIPLE:
        return None
    return Int4Groups(values(), scales, biases, g_idx, group_size, dtype)


def cuda_matmul(qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None,
                g_idx: torch.Tensor) -> Matmul | None:
    if qweight.device.type != "cuda" or not triton_support.available(qweight.device):
        return None
    return lambda x: triton_quant_matmul.quantized_matmul(x, qweight, scales, biases, g_idx)


def _group_size(g_idx: torch.Tensor, num_groups: int) -> int | None:
    """The size of every group but the last, which may be shorter (columns in any order)."""
    counts = torch.bincount(g_idx.long(), minlength=num_groups)
    size = int(counts[0])
    return size if bool((counts[:-1] == size).all()) and int(counts[-1]) <= size else None


class _Int8Rows(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.qweight, self.scales = qweight.data, scales  # .data: not a second parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        return out.view(*x.shape[:-1], -1)


class Int8PairBlocks(nn.Module):
    owns_weight = True  # a packed copy: the storage it was made from can go

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, kernels):
        super().__init__()
        self.out_features, self.kernels = qweight.shape[0], kernels
        self.register_buffer("packed", cpu_gemm.pack_pair_blocks(qweight))
        self.register_buffer("scales", scales.float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = self.kernels.int8_matmul(flat, self.packed, self.scales, self.out_features)
        return out.view(*x.shape[:-1], -1)


class Int4Groups(nn.Module):
    owns_weight = True  # its packed copy: the storage it was made from can go

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None,
                 g_idx: torch.Tensor, group_size: int, dtype: torch.dtype):
        super().__init__()
        order = torch.argsort(g_idx, stable=True)
        self.order = None if torch.equal(order, torch.arange(len(order))) else order
        values = values.to(torch.int32)
        if self.order is not None:
            values = values[:, self.order]
        self.padding = scales.shape[1] * group_size - values.shape[1]
        values = F.pad(values, (0, self.padding))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            values.contiguous(), 1))
        zeros = scales * INT4_OFFSET + (biases if biases is not None else 0)
        self.register_buffer("scales_and_zeros",
                             torch.stack((scales.T, zeros.T), dim=-1).to(dtype).contiguous())
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.order is not None:
            flat = flat.index_select(1, self.order)
        if self.padding:
            flat = F.pad(flat, (0, self.padding))
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.packed,
                                                         self.group_size, self.scales_and_zeros)
        return out.view(*x.shape[:-1], -1)
