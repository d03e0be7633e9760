"""A fused dequantize-and-matmul Triton kernel for the weight-only quantized storage of
`quantization.py`: each program dequantizes [BLOCK_K, BLOCK_N] tiles of the weight in registers
and feeds them to `tl.dot`, so the float weight never exists in memory.

Triton is optional (triton_support.py).
"""
import functools

import torch

from tritonlm.layers.cpu_kernels import FLOAT_DTYPES
from tritonlm.layers.triton_support import available, interpreting, triton_modules


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit
    def kernel(x_ptr, q_ptr, scales_ptr, biases_ptr, g_idx_ptr, out_ptr, M, N, K,
               stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg,
               stride_om, stride_on,
               BITS: tl.constexpr, HAS_BIASES: tl.constexpr, DOT_PRECISION: tl.constexpr,
               DOT_IN_FP32: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        PER_BYTE: tl.constexpr = 8 // BITS
        # int64 rows: a large weight's (or lm_head's) row offsets overflow int32.
        offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            # The weight tile is loaded transposed, [BLOCK_K, BLOCK_N], ready for x @ w.
            mask_w = mask_k[:, None] & mask_n[None, :]
            q = tl.load(q_ptr + offs_n[None, :] * stride_qn
                        + (offs_k // PER_BYTE)[:, None] * stride_qk, mask=mask_w, other=0)
            if BITS == 4:  # uint8 bytes: even columns in the low nibble, odd in the high one
                q = (q.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 0xF
            groups = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
            group_offs = offs_n[None, :] * stride_sn + groups[:, None] * stride_sg
            w = q.to(tl.float32) * tl.load(scales_ptr + group_offs, mask=mask_w, other=0.0)
            if HAS_BIASES:
                w += tl.load(biases_ptr + group_offs, mask=mask_w, other=0.0)
            w = w.to(x.dtype)
            if DOT_IN_FP32:  # the same values, multiplied as float32
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    return kernel


def _check(x, qweight, scales, biases, g_idx) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, not {x.dtype}")
    if qweight.dtype not in (torch.uint8, torch.int8) or qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D uint8 (4 bits) or int8 (8 bits), "
                         f"not {qweight.dtype} {tuple(qweight.shape)}")
    in_features = g_idx.shape[0]
    unpacked = qweight.shape[1] * (2 if qweight.dtype == torch.uint8 else 1)
    if g_idx.dim() != 1 or unpacked != in_features:
        raise ValueError(f"qweight {tuple(qweight.shape)} ({qweight.dtype}) does not match "
                         f"g_idx of {in_features} input columns")
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight has {in_features}")
    expected = (qweight.shape[0], scales.shape[-1])
    if scales.dim() != 2 or tuple(scales.shape) != expected:
        raise ValueError(f"scales must be [out, groups] = {expected}, not {tuple(scales.shape)}")
    if biases is not None and biases.shape != scales.shape:
        raise ValueError(f"biases {tuple(biases.shape)} must match scales {tuple(scales.shape)}")
    if any(t is not None and t.device != x.device for t in (qweight, scales, biases, g_idx)):
        raise ValueError("x and the quantized weight must be on the same device")


def quantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     biases: torch.Tensor | None, g_idx: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N_out] in x's dtype, W = dequantize(qweight, scales, biases,
    g_idx); 4 bits for a uint8 qweight, 8 bits for int8."""
    _check(x, qweight, scales, biases, g_idx)
    if not available(x.device):
        raise RuntimeError(f"the Triton quantized matmul cannot run on {x.device}")
    leading = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = qweight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*leading, n)
    scales = scales.to(torch.float32)
    biases = biases.to(torch.float32) if biases is not None else None
    g_idx = g_idx.to(torch.int32).contiguous()
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, (32 if k <= 32 else 64)
    grid = (-(-m // block_m), -(-n // block_n))
    _kernel()[grid](
        x2, qweight, scales, biases if biases is not None else scales, g_idx, out, m, n, k,
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), out.stride(0), out.stride(1),
        BITS=4 if qweight.dtype == torch.uint8 else 8, HAS_BIASES=biases is not None,
        # fp32 inputs keep torch's default of exact fp32 products (no TF32); fp16/bf16
        # operands go to the tensor cores whatever this says.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        # The interpreter keeps bfloat16 as uint16 bit patterns, which its tl.dot multiplies
        # as integers; it documents no bfloat16 arithmetic.
        DOT_IN_FP32=x.dtype == torch.bfloat16 and interpreting(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3)
    return out.view(*leading, n)

