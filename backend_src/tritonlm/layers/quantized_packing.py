"""int8 and 4-bit weights and their group parameters laid out as our quantized CPU kernel
(csrc/quantized_matmul.cpp) reads them: pairs of input features per block of 32 output features,
as cpu_gemm packs bf16 weights."""
import torch
import torch.nn.functional as F

from tritonlm.layers import cpu_gemm


def packed_values(values: torch.Tensor, gated: bool, kernels) -> torch.Tensor:
    """int8 or 4-bit values [out, in] as our kernel reads them (see quantized_matmul.PairBlocks)."""
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


def packed_groups(scales: torch.Tensor, biases: torch.Tensor | None, gated: bool
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
