"""Which path our quantized CPU kernel (quantized_matmul.PairBlocks) takes for a matmul of so many
rows on this CPU: int8 inputs with integer dot products, the float tiles, the weight dequantized
once for float32 sgemm, or each block dequantized to bfloat16 for AMX tiles or AVX512-BF16 dot
products. Fixed limits where one path won on every CPU measured; measured once per process at
first use where the winner differs between CPUs of one class."""
import functools

import torch

from tritonlm.layers import cpu_gemm, quantized_packing

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


@functools.cache
def sgemm_rows_for_this_cpu(kernels) -> int:
    """From how many rows our kernel dequantizes the whole weight for float32 sgemm
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
    weight (int8: a scale per row; 4 bits: groups of 32), packed here, not by quantized_matmul.PairBlocks (no
    region space for a throwaway), as a function of the arguments, for timing."""
    seeded = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=seeded, dtype=torch.bfloat16)
    if bits == 8:
        values = torch.randint(-127, 128, (1536, 576), generator=seeded, dtype=torch.int8)
        row_scales, groups, group_size = torch.full((1536,), 0.01), None, 576
    else:
        values = torch.randint(0, 16, (1536, 576), generator=seeded, dtype=torch.uint8)
        row_scales, group_size = None, 32
        groups = quantized_packing.packed_groups(
            torch.full((1536, 18), 0.01), torch.full((1536, 18), -0.08), False)
    packed = quantized_packing.packed_values(values, False, kernels)
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
