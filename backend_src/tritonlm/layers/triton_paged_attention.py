"""Paged decode attention as an OpenAI-Triton kernel, for CUDA without flash-attn: one query token
per row reads its K/V where they lie in the paged cache (no gather), with the same arguments and
result as the CPU kernel's `decode_attention` (layers/cpu_kernels.py), so the layer calls either.

One program per (row, kv head, context split) loads each key block once for the G query heads
that share it (GQA / MQA) and keeps a streaming softmax in float32; ALiBi slopes and sliding
windows as the PyTorch path applies them. Few rows leave most of a GPU idle (batch 1: one program
per kv head, each walking the whole context), so the context is split over more programs, as
flash-decoding and vLLM's PagedAttention v2 do: each split writes its running max, sum and
unnormalised output, and a second kernel merges them. The split count depends only on the shapes
(a CUDA graph replays one grid for every context length), but each row's context is shared out
over all its splits: a program's loop is latency-bound (a block index, then its keys and values,
per iteration), so a short context in a long max_model_len walks one or two blocks per split
rather than one split's fixed share of max_model_len. Under TRITON_INTERPRET=1 it also runs on
CPU tensors (the tests).
"""
import functools

import torch

from tritonlm.layers.triton_support import interpreting, triton_modules

# Programs to aim for per multiprocessor; at most one split per MIN_SPLIT_TOKENS of the longest
# context (what the merge reads grows with the splits).
PROGRAMS_PER_SM = 2
MIN_SPLIT_TOKENS = 128


@functools.cache
def _kernels():
    triton, tl = triton_modules()

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, blocks_ptr, lens_ptr, slopes_ptr, out_ptr, max_ptr,
                     sum_ptr, scale, window,
                     stride_qb, stride_qh, stride_kr, stride_kt, stride_bb, stride_bh,
                     stride_ob, stride_oh,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                     BS: tl.constexpr, BSP: tl.constexpr, HAS_SLOPES: tl.constexpr,
                     SPLITS: tl.constexpr):
        """SPLITS 1: the normalised output into out [B, Hq, D]. Otherwise the split's running
        max and sum into max/sum [B, Hq, SPLITS] and its unnormalised output into
        out [B, Hq, SPLITS, D]."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
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
        first_block = first // BS
        per_split = tl.cdiv(tl.cdiv(context, BS) - first_block, SPLITS)
        start = first_block + split * per_split
        end = tl.minimum(tl.cdiv(context, BS), start + per_split)
        for j in range(start, end):
            cache_row = tl.load(blocks_ptr + row * stride_bb + kv_head * stride_bh + j).to(tl.int64)
            positions = j * BS + offs_t
            valid = (offs_t < BS) & (positions < context) & (positions >= first)
            offsets = cache_row * stride_kr + offs_t[:, None] * stride_kt + offs_d[None, :]
            kv_mask = valid[:, None] & mask_d[None, :]
            k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)  # beside k's
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BSP]
            if HAS_SLOPES:
                scores += slopes[:, None] * (positions - (context - 1)).to(tl.float32)[None, :]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            alpha = tl.exp(running_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            running_max = new_max
        mask_out = mask_g[:, None] & mask_d[None, :]
        if SPLITS == 1:
            out = acc / tl.where(total > 0, total, 1.0)[:, None]  # an empty context gives zeros
            tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=mask_out)
        else:
            index = (row * (stride_ob // stride_oh) + heads) * SPLITS + split  # in [B, Hq, SPLITS]
            tl.store(max_ptr + index, running_max, mask=mask_g)
            tl.store(sum_ptr + index, total, mask=mask_g)
            tl.store(out_ptr + index[:, None] * D + offs_d[None, :], acc, mask=mask_out)

    @triton.jit
    def merge_kernel(partial_ptr, max_ptr, sum_ptr, out_ptr,
                     D: tl.constexpr, DP: tl.constexpr, SPLITS: tl.constexpr,
                     SP: tl.constexpr):
        """One program per (row, query head): the splits' outputs, each rescaled from its own
        running max to the largest, over the rescaled sums."""
        head = tl.program_id(0)  # row * Hq + head
        offs_s = tl.arange(0, SP)
        offs_d = tl.arange(0, DP)
        mask_s = offs_s < SPLITS
        maxima = tl.load(max_ptr + head * SPLITS + offs_s, mask=mask_s, other=float("-inf"))
        sums = tl.load(sum_ptr + head * SPLITS + offs_s, mask=mask_s, other=0.0)
        largest = tl.max(maxima, axis=0)
        # Splits that saw no key keep max -inf: weight 0 (and so does everything for a row whose
        # context is empty, whose output is zeros).
        weights = tl.where(maxima > float("-inf"), tl.exp(maxima - largest), 0.0)
        partial = tl.load(partial_ptr + (head * SPLITS + offs_s)[:, None] * D + offs_d[None, :],
                          mask=mask_s[:, None] & (offs_d < D)[None, :], other=0.0)
        total = tl.sum(weights * sums, axis=0)
        out = tl.sum(weights[:, None] * partial, axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + head * D + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)

    return triton, split_kernel, merge_kernel


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def context_splits(rows: int, num_kv_heads: int, max_blocks: int, block_size: int,
                   device: torch.device) -> int:
    """How many programs share each (row, kv head)'s context: enough to give every
    multiprocessor PROGRAMS_PER_SM programs, at most one per MIN_SPLIT_TOKENS of max_blocks'
    tokens; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    wanted = -(-PROGRAMS_PER_SM * _multiprocessors(device) // (rows * num_kv_heads))
    most = -(-max_blocks * block_size // MIN_SPLIT_TOKENS)
    return max(1, min(wanted, most))


def decode_attention(q: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
                     blocks: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     slopes: torch.Tensor | None = None, window: int = 0,
                     splits: int | None = None) -> torch.Tensor:
    """q [B, Hq, D]; key_rows, value_rows [R, bs, D] (the cache as [num_blocks * Hkv, bs, D]);
    blocks [B, Hkv, nb] the rows holding each row's keys, bs at a time; context_lens [B];
    slopes [Hq] ALiBi or None; window 0 or the sliding window; splits: programs per (row, kv
    head), by default `context_splits`. Returns [B, Hq, D]."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads, max_blocks = blocks.shape[1:]
    block_size = key_rows.shape[1]
    if num_heads % num_kv_heads or key_rows.shape != value_rows.shape or key_rows.shape[2] != head_dim:
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, K/V rows {tuple(key_rows.shape)}, "
                         f"blocks {tuple(blocks.shape)} do not fit together")
    q, key_rows, value_rows = q.contiguous(), key_rows.contiguous(), value_rows.contiguous()
    # The kernel rounds its float32 result into q's dtype (no cast kernel after it), except under
    # the interpreter, which truncates float32 to bfloat16: there torch casts.
    out = torch.empty(q.shape, dtype=torch.float32 if interpreting() else q.dtype,
                      device=q.device)
    if rows == 0:
        return out.to(q.dtype)
    if splits is None:
        splits = context_splits(rows, num_kv_heads, max_blocks, block_size, q.device)
    triton, split_kernel, merge_kernel = _kernels()
    group = num_heads // num_kv_heads
    blocks = blocks.contiguous()
    partial = out if splits == 1 else torch.empty(
        (rows, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    maxima, sums = (partial, partial) if splits == 1 else (
        torch.empty((rows, num_heads, splits), dtype=torch.float32, device=q.device)
        for _ in range(2))
    split_kernel[(rows, num_kv_heads, splits)](
        q, key_rows, value_rows, blocks, context_lens.contiguous(),
        slopes.float().contiguous() if slopes is not None else q, partial, maxima, sums,
        float(scale), int(window),
        q.stride(0), q.stride(1), key_rows.stride(0), key_rows.stride(1),
        blocks.stride(0), blocks.stride(1), out.stride(0), out.stride(1),
        G=group, GP=triton.next_power_of_2(group), D=head_dim,
        DP=triton.next_power_of_2(head_dim), BS=block_size,
        BSP=triton.next_power_of_2(block_size), HAS_SLOPES=slopes is not None, SPLITS=splits)
    if splits > 1:
        merge_kernel[(rows * num_heads,)](
            partial, maxima, sums, out, D=head_dim, DP=triton.next_power_of_2(head_dim),
            SPLITS=splits, SP=triton.next_power_of_2(splits))
    return out.to(q.dtype)  # a no-op unless interpreting
