"""Paged decode attention as an OpenAI-Triton kernel, for CUDA without flash-attn: one query token
per row reads its K/V where they lie in the paged cache (no gather), with the same arguments and
result as the CPU kernel's `decode_attention` (layers/cpu_kernels.py), so the layer calls either.

One program per (row, kv head) loads each key block once for the G query heads that share it
(GQA / MQA) and keeps a streaming softmax in float32; ALiBi slopes and sliding windows as the
PyTorch path applies them. Under TRITON_INTERPRET=1 it also runs on CPU tensors (the tests).
"""
import functools

import torch

from tritonlm.layers.triton_support import triton_modules


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, blocks_ptr, lens_ptr, slopes_ptr, out_ptr, scale, window,
               stride_qb, stride_qh, stride_kr, stride_kt, stride_bb, stride_bh,
               stride_ob, stride_oh,
               G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
               BS: tl.constexpr, BSP: tl.constexpr, HAS_SLOPES: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        context = tl.load(lens_ptr + row).to(tl.int32)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, DP)
        offs_t = tl.arange(0, BSP)
        mask_g = offs_g < G
        mask_d = offs_d < D
        heads = kv_head * G + offs_g
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        if HAS_SLOPES:
            slopes = tl.load(slopes_ptr + heads, mask=mask_g, other=0.0).to(tl.float32)
        first = 0
        if window > 0:
            first = tl.maximum(context - window, 0)
        running_max = tl.full((GP,), float("-inf"), tl.float32)
        total = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, DP), tl.float32)
        for j in range(first // BS, tl.cdiv(context, BS)):
            cache_row = tl.load(blocks_ptr + row * stride_bb + kv_head * stride_bh + j).to(tl.int64)
            positions = j * BS + offs_t
            valid = (offs_t < BS) & (positions < context) & (positions >= first)
            offsets = cache_row * stride_kr + offs_t[:, None] * stride_kt + offs_d[None, :]
            kv_mask = valid[:, None] & mask_d[None, :]
            k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BSP]
            if HAS_SLOPES:
                scores += slopes[:, None] * (positions - (context - 1)).to(tl.float32)[None, :]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            alpha = tl.exp(running_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            running_max = new_max
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # an empty context gives zeros
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out, mask=mask_g[:, None] & mask_d[None, :])

    return triton, kernel


def decode_attention(q: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
                     blocks: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     slopes: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """q [B, Hq, D]; key_rows, value_rows [R, bs, D] (the cache as [num_blocks * Hkv, bs, D]);
    blocks [B, Hkv, nb] the rows holding each row's keys, bs at a time; context_lens [B];
    slopes [Hq] ALiBi or None; window 0 or the sliding window. Returns [B, Hq, D]."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = blocks.shape[1]
    block_size = key_rows.shape[1]
    if num_heads % num_kv_heads or key_rows.shape != value_rows.shape or key_rows.shape[2] != head_dim:
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, K/V rows {tuple(key_rows.shape)}, "
                         f"blocks {tuple(blocks.shape)} do not fit together")
    q, key_rows, value_rows = q.contiguous(), key_rows.contiguous(), value_rows.contiguous()
    # float32 out, cast by torch: the interpreter truncates float32 to bfloat16 instead of rounding
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if rows == 0:
        return out.to(q.dtype)
    triton, kernel = _kernel()
    group = num_heads // num_kv_heads
    blocks = blocks.contiguous()
    kernel[(rows, num_kv_heads)](
        q, key_rows, value_rows, blocks, context_lens.contiguous(),
        slopes.float().contiguous() if slopes is not None else q, out, float(scale), int(window),
        q.stride(0), q.stride(1), key_rows.stride(0), key_rows.stride(1),
        blocks.stride(0), blocks.stride(1), out.stride(0), out.stride(1),
        G=group, GP=triton.next_power_of_2(group), D=head_dim,
        DP=triton.next_power_of_2(head_dim), BS=block_size,
        BSP=triton.next_power_of_2(block_size), HAS_SLOPES=slopes is not None)
    return out.to(q.dtype)
