"""Fused matmuls on weight-only quantized storage (quantization.py), chosen once per layer:
- CPU with our kernels built (AVX2 + FMA or AVX512), float32 or bfloat16 inputs: our kernel
  (csrc/quantized_matmul.cpp) on a copy packed as cpu_gemm packs bf16 weights, for int8 with a
  scale per output row, and int8 or 4 bits in groups of any even size (the last may be shorter;
  act-order columns sorted by group once, each input permuted alike). On 2 Zen 1 cores it ran
  SmolLM2's int8 matmul shapes 6-12x faster than torch's int8 kernel with float32 inputs,
  1.3-1.5x with bfloat16 ones. With `int8_inputs`, inputs of under `int8_rows` rows (decode
  batches; with AVX512-VNNI, every 4-bit matmul) are quantized to int8 per row and group and
  multiplied with integer dot products (w4a8, w8a8); bfloat16 inputs from AMX_ROWS rows
  (batches, prompts) multiply each block dequantized to bfloat16 in AMX tiles on CPUs with AMX,
  from DOT_ROWS rows by AVX512-BF16 dot products where those are the CPU's faster way;
- CPU otherwise: torch's int4 kernel (groups of 32-256, output rows a multiple of 16) or int8
  kernel (a scale per row), on the storage or a copy in its layout;
- CUDA with OpenAI Triton installed: our Triton kernel (triton_quant_matmul.py), any layout.
Any other layout dequantizes the weight for each matmul (`QuantizedWeight.forward`)."""
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tritonlm.layers import (cpu_gemm, cpu_kernels, huge_pages, triton_quant_matmul,
                             triton_support)

INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_ROW_MULTIPLE = 16  # its packed layout holds output rows in tiles of 16
INT4_OFFSET = 8  # torch's int4 kernel computes w = (q - 8) * scale + zero
# Rows below which int8_inputs quantize x, by weight bits: 4 bits, decode batches up to the
# default max_num_seqs, where the float tiles are bound by widening weights (Zen 1, SmolLM2's 120
# int4 matmuls, float tiles -> int8: 1 row 11.0 -> 7.2 ms, 15 rows 96 -> 50, 64 rows 275 -> 217,
# 256 rows 979 -> 769); 8 bits, where int8 dots won (1 row 15.2 -> 10.8 ms, 15 rows 99 -> 76,
# 64 rows 317 -> 309; 128 rows 594 -> 606). Longer prompts keep float inputs, unless 4-bit
# prompts measured faster on int8 inputs (int8_prompts_for_this_cpu: a Zen 5 core in the AVX2
# build, whole int4 prompts of 256 / 512 / 1024 tokens 629 / 895 / 2192 -> 316 / 614 / 1676 ms).
# These are the AVX2 integer dots' limits (on AVX512 builds without VNNI too).
INT8_ROWS = {4: 256, 8: 64}
# With AVX512-VNNI, vpdpbusd dots beat the float tiles and sgemm at every row count (2 Cascade Lake
# vCPUs, SmolLM2's 120 matmuls, float -> int8 inputs: int4 1 row 8.2 -> 6.6 ms, 32 rows 80 -> 38,
# 255 rows 497 -> 232, 512 rows (sgemm) 704 -> 484, 1024 rows 1200 -> 926; int8 1.2-1.6x at 1-4
# rows, 1.7-2.3x at 15-255, 1.4-1.6x at 512-1024): every 4-bit matmul takes int8 inputs there.
# int8 weights keep float inputs from 64 rows all the same: int8 inputs on prompts raised
# SmolLM2's int8 perplexity 2.5% over bf16 (42.31 vs 41.25), past the 1% int8 weights keep.
VNNI_INT8_ROWS = {4: 1 << 62, 8: 64}
# Rows from which bfloat16 inputs multiply each block dequantized to bfloat16 in AMX tiles, where
# the CPU has them (2 Emerald Rapids cores, SmolLM2's shapes, against VNNI int8 inputs (int4 g32)
# or float tiles (int8 rows) at 1 / 16 / 32 / 200 / 2048 rows: int4 0.34x / 1.07x / 1.70x / 2.05x
# / 2.30x, int8 1.13x at 16 rows, 1.73x at 32, 3.0-3.7x from 200). Below, the dequantizing is
# not shared by enough rows.
AMX_ROWS = 32
# Likewise by AVX512-BF16 dot products, where they are the CPU's faster way and measured faster
# on a prompt (dot_rows_for_this_cpu). 2 Zen 5 cores, SmolLM2's 4 matmul shapes at 1 / 8 / 16 /
# 24 / 32 / 64 / 128 / 512 / 1024 rows, against VNNI int8 inputs (int4 g32): 0.48x / 0.78x /
# 0.92x / 1.08x / 1.23x / 1.58x / 1.67x / 1.23x / 1.34x; int8 rows against int8 inputs below 64
# rows, float tiles from there: 0.52x at 1 row, 1.08x at 24, 1.05x at 32, 1.8x from 64; bfloat16
# weights' own time: 1.01-1.2x from 32 rows.
DOT_ROWS = 24
DOT_MEASURED_ROWS = 128
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
        return PairBlocks(values(), scales, biases, g_idx, group_size, kernels,
                          int8_rows=int8_rows(kernels, 4 if qweight.dtype == torch.uint8 else 8)
                          if int8_inputs else 0, gated=gated)
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


@functools.cache
def sgemm_rows_for_this_cpu(kernels) -> int:
    """From how many rows quantized_matmul dequantizes the whole weight for float32 sgemm
    (cpu_gemm.measured_sgemm_rows), measured once per process on int8 rows of a SmolLM2-sized
    weight. Apart from bf16's: a prompt's tiles here dequantize each block into a buffer
    before multiplying it, where bf16 tiles widen in registers (Zen 3, 512 rows: bf16 tiles
    131-165 GFLOP/s against sgemm's 124-143; int8 and int4 tiles 73-106 against 109-137)."""
    def int8_matmul():
        run = _sized_matmul(kernels, 8, cpu_gemm.PROMPT_ROWS)
        return lambda sgemm_rows: run({"sgemm_rows": sgemm_rows})

    return cpu_gemm.measured_sgemm_rows(int8_matmul)


def _sized_matmul(kernels, bits: int, rows: int):
    """quantized_matmul(**arguments) on `rows` bfloat16 rows times a SmolLM2-sized `bits`-bit
    weight (int8: a scale per row; 4 bits: groups of 32), packed here, not by PairBlocks (no
    region space for a throwaway), as a function of the arguments, for timing."""
    seeded = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=seeded, dtype=torch.bfloat16)
    if bits == 8:
        values = torch.randint(-127, 128, (1536, 576), generator=seeded, dtype=torch.int8)
        row_scales, groups, group_size = torch.full((1536,), 0.01), None, 576
    else:
        values = torch.randint(0, 16, (1536, 576), generator=seeded, dtype=torch.uint8)
        row_scales, group_size = None, 32
        groups = _packed_groups(torch.full((1536, 18), 0.01), torch.full((1536, 18), -0.08), False)
    packed = _packed_values(values, False, kernels)
    return lambda arguments: kernels.quantized_matmul(x, packed, row_scales, groups, group_size,
                                                      1536, **arguments)


def int8_rows(kernels, bits: int) -> int:
    """Rows below which our kernel multiplies `bits`-bit weights by inputs quantized to int8."""
    if kernels.has_vnni_dot_products or (bits == 4 and int8_prompts_for_this_cpu(kernels)):
        return VNNI_INT8_ROWS[bits]
    return INT8_ROWS[bits]


@functools.cache
def int8_prompts_for_this_cpu(kernels) -> bool:
    """Whether 4-bit weights without VNNI ran a SmolLM2-sized prompt (cpu_gemm.PROMPT_ROWS rows)
    over 10% faster on int8 inputs than on the float path (the tiles, or sgemm where measured
    faster), once per process."""
    return cpu_gemm.runs_faster(_sized_matmul(kernels, 4, cpu_gemm.PROMPT_ROWS),
                                {"int8_rows": 1 << 62},
                                {"int8_rows": INT8_ROWS[4],
                                 "sgemm_rows": sgemm_rows_for_this_cpu(kernels)})


def dequantized_bf16_rows(kernels, bits: int) -> tuple[int, bool]:
    """From how many rows of bfloat16 inputs our kernel dequantizes each block of a `bits`-bit
    weight to bfloat16 and multiplies it as bfloat16 weights (0: never), and whether in AMX tiles
    (else by AVX512-BF16 dot products): where either is this CPU's way for bfloat16 weights
    (cpu_gemm), dot products where they also measured faster than the other paths."""
    if cpu_gemm.amx_for_this_cpu(kernels):
        return AMX_ROWS, True
    if kernels.has_bf16_dot_products and not cpu_gemm.widen_for_this_cpu(kernels):
        return dot_rows_for_this_cpu(kernels, bits), False
    return 0, False


@functools.cache
def dot_rows_for_this_cpu(kernels, bits: int) -> int:
    """DOT_ROWS where dot products on blocks dequantized to bfloat16 ran a SmolLM2-sized `bits`-bit
    weight on DOT_MEASURED_ROWS bfloat16 rows over 10% faster than the other paths (Zen 5:
    1.6-1.9x), else 0; measured once per process (~15 ms)."""
    paths = {"int8_rows": int8_rows(kernels, bits)}
    return DOT_ROWS if cpu_gemm.runs_faster(_sized_matmul(kernels, bits, DOT_MEASURED_ROWS),
                                            {**paths, "bf16_rows": 1}, paths) else 0


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
    `_quad_rows`). Dequantized by one scale per output row (int8, no biases: applied to the
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
        # prompts multiplied as bfloat16 weights, each block dequantized (bfloat16 inputs)
        self.bf16_rows, self.amx = dequantized_bf16_rows(
            kernels, 4 if values.dtype == torch.uint8 else 8)
        # prompts: the weight dequantized once and run by float32 sgemm, where that is faster
        # than the kernel's tiles
        self.sgemm_rows = sgemm_rows_for_this_cpu(kernels) if sgemm_rows is None else sgemm_rows
        self.order, values = _sorted_by_group(values, g_idx)
        self.group_size = group_size
        four_bits = values.dtype == torch.uint8
        per_row = not four_bits and scales.shape[1] == 1 and biases is None
        self.register_buffer("packed", huge_pages.place(_packed_values(values, gated, kernels)))
        for name in ("row_scales", "groups", "row_groups"):
            self.register_buffer(name, None)
        if per_row:
            self.row_scales = scales[:, 0].float().contiguous()
            if int8_rows:  # int8 inputs are scaled per group: the row's scale in each
                num_groups = -(-values.shape[1] // ROW_GROUP_SIZE)
                self.row_groups = huge_pages.place(
                    _packed_groups(scales.expand(-1, num_groups), None, gated))
        else:
            self.groups = huge_pages.place(_packed_groups(scales, biases, gated))

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


def _packed_values(values: torch.Tensor, gated: bool, kernels) -> torch.Tensor:
    """int8 or 4-bit values [out, in] as our kernel reads them (see PairBlocks)."""
    if values.dtype != torch.uint8:
        return cpu_gemm.pack_pair_blocks(values, gated)
    if kernels.has_int4_quads:
        return _quad_rows(values, gated)
    packed = cpu_gemm.pack_pair_blocks(values, gated)
    return packed[..., 0] | (packed[..., 1] << 4)


def _quad_rows(values: torch.Tensor, gated: bool) -> torch.Tensor:
    """4-bit values [out, in] in the kernel's quad rows (Int4Quads, csrc/packed_matmul_registers.h):
    [blocks, 2 * ceil(in / 4), 32] bytes; byte 4l + i of a block's quad row q holds its feature
    l's value 4q + i in the low nibble, feature 16 + l's in the high one."""
    pairs = cpu_gemm.pack_pair_blocks(F.pad(values, (0, -values.shape[1] % 4)), gated)
    blocks, rows = pairs.shape[:2]  # [blocks, rows, 32, 2]: pair row 2q + s holds 4q + 2s, + 1
    quads = pairs.view(blocks, rows // 2, 2, 32, 2).transpose(2, 3).reshape(blocks, -1, 32, 4)
    return (quads[:, :, :16] | (quads[:, :, 16:] << 4)).reshape(blocks, rows, 32)


def _packed_groups(scales: torch.Tensor, biases: torch.Tensor | None, gated: bool
                   ) -> torch.Tensor:
    """[out, G] scales and biases (None: zeros) as the kernel reads them: [blocks, G, 2, 32],
    float16 where every one is exact in it (GGUF's, our converter's: at 4 bits in groups of
    32, a fifth of the bytes the kernel reads instead of a third), else float32 (GPTQ's biases
    -zero * scale)."""
    params = torch.stack((scales, torch.zeros_like(scales) if biases is None else biases),
                         dim=-1).float()  # [out, G, 2]
    if torch.equal(params.half().float(), params):
        params = params.half()
    blocked = cpu_gemm.pack_block_features(params, gated)  # [blocks, 32, G, 2]
    return blocked.permute(0, 2, 3, 1).contiguous()


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
