"""The fused per-token ops of csrc/fused_ops.cpp and kv_cache_write.cpp as OpenAI-Triton kernels,
for CUDA: the same functions, arguments and roundings (each intermediate that Hugging Face's
unfused ops round to the model dtype is rounded here too; the math in float32).

Unfused, a decode step's layer is some thirty small kernels (RMSNorm alone: a cast, a square, a
mean, an add, an rsqrt, two multiplies and a cast back); at small batches each costs a launch's
few microseconds on the GPU, far more than the bytes it moves. Fused, each op is one kernel
(the greedy argmax two: a row's chunks in parallel, then their merge). Under TRITON_INTERPRET=1
they also run on CPU tensors (the tests).
"""
import functools

import torch

from tritonlm.layers.cpu_kernels import FLOAT_DTYPES
from tritonlm.layers.triton_support import triton_modules

ACTIVATIONS = (0, 1)  # silu, gelu with the tanh approximation (layers/activation.py's codes)
# No multiply-add contraction (csrc's -ffp-contract=off): LLVM narrows a product rounded to a
# 16-bit dtype into a 16-bit multiply, which the GPU would then fuse with the add after it into
# one fma, rounding once where Hugging Face's ops round twice.
UNFUSED = {"enable_fp_fusion": False}
ARGMAX_CHUNK = 4096  # logits per program of argmax_logsumexp (a 128k vocabulary: 32 a row)


@functools.cache
def _kernels():
    triton, tl = triton_modules()

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, res_ptr, out_ptr, stride_x, stride_res, stride_out, H, eps,
                        HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        dtype = out_ptr.dtype.element_ty
        h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:  # residual += x, rounded as HF's `residual + hidden_states`
            res = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
            h = (h + res.to(tl.float32)).to(dtype).to(tl.float32)
            tl.store(res_ptr + row * stride_res + offs, h.to(dtype), mask=mask)
        scale = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        normed = h * scale
        # Llama casts the normalised row to the dtype, then scales; Gemma scales by 1 + w first.
        if OFFSET:
            out = normed * (1.0 + w)
        else:
            out = normed.to(dtype).to(tl.float32) * w
        tl.store(out_ptr + row * stride_out + offs, out.to(dtype), mask=mask)

    @triton.jit
    def act_and_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_out, ACTIVATION: tl.constexpr,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
        if ACTIVATION == 0:
            active = gate / (1.0 + tl.exp(-gate))
        else:  # 0.5 x (1 + tanh(y)) as torch computes it. Near y << 0, 1 + tanh cancels, so
            # tanh must be rounded as torch's (correctly rounded) one is: from float64.
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            e = tl.exp(-2.0 * tl.abs(inner).to(tl.float64))
            tanh = ((1.0 - e) / (1.0 + e)).to(tl.float32)
            active = 0.5 * gate * (1.0 + tl.where(inner < 0, -tanh, tanh))
        out = active.to(dtype).to(tl.float32) * up
        tl.store(out_ptr + row * stride_out + offs, out.to(dtype), mask=mask)

    @triton.jit
    def rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_c, stride_s, HALF,
                      BLOCK: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        dtype = x_ptr.dtype.element_ty
        p = x_ptr + token * stride_xt + head * stride_xh + offs
        a = tl.load(p, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
        c = cos_ptr + token * stride_c + offs
        s = sin_ptr + token * stride_s + offs
        cos_low = tl.load(c, mask=mask, other=0.0).to(tl.float32)
        cos_high = tl.load(c + HALF, mask=mask, other=0.0).to(tl.float32)
        sin_low = tl.load(s, mask=mask, other=0.0).to(tl.float32)
        sin_high = tl.load(s + HALF, mask=mask, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded as HF's ops round it.
        low = (a * cos_low).to(dtype).to(tl.float32) - (b * sin_low).to(dtype).to(tl.float32)
        high = (b * cos_high).to(dtype).to(tl.float32) + (a * sin_high).to(dtype).to(tl.float32)
        tl.store(p, low.to(dtype), mask=mask)
        tl.store(p + HALF, high.to(dtype), mask=mask)

    @triton.jit
    def write_kv_kernel(kc_ptr, vc_ptr, k_ptr, v_ptr, rows_ptr, H, D, stride_c, stride_kt,
                        stride_kh, stride_vt, stride_vh, BLOCK: tl.constexpr):
        index = tl.program_id(0)  # token * H + kv head
        token = index // H
        head = index % H
        row = tl.load(rows_ptr + index)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        k = tl.load(k_ptr + token * stride_kt + head * stride_kh + offs, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + head * stride_vh + offs, mask=mask)
        tl.store(kc_ptr + row * stride_c + offs, k, mask=mask)
        tl.store(vc_ptr + row * stride_c + offs, v, mask=mask)

    @triton.jit
    def argmax_logsumexp_part_kernel(logits_ptr, max_ptr, index_ptr, nan_ptr, sum_ptr, V, stride,
                                     PARTS, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """One chunk of a row in one pass: its maximum, the first index holding it, its first
        NaN, and the sum of exp(logit - maximum) (a running sum rescaled as the maximum grows)."""
        row, part = tl.program_id(0), tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        best = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_index = tl.full((BLOCK,), 2147483647, tl.int32)
        first_nan = tl.full((BLOCK,), 2147483647, tl.int32)
        total = tl.zeros((BLOCK,), tl.float32)
        for start in range(part * CHUNK, part * CHUNK + CHUNK, BLOCK):
            index = start + offs
            v = tl.load(logits_ptr + row * stride + index, mask=index < V,
                        other=float("-inf")).to(tl.float32)
            first_nan = tl.minimum(first_nan, tl.where(v != v, index, 2147483647))
            better = v > best  # each lane keeps its first maximum; NaN is never better
            best_index = tl.where(better | ((v == best) & (best_index == 2147483647)), index,
                                  best_index)
            grown = tl.where(better, v, best)
            empty = grown == float("-inf")
            total = tl.where(empty, 0.0, total * tl.exp(best - grown) + tl.exp(v - grown))
            best = grown
        largest = tl.max(best, axis=0)
        lane_sums = tl.where(best == float("-inf"), 0.0, total * tl.exp(best - largest))
        out = row * PARTS + part
        tl.store(max_ptr + out, largest)
        tl.store(index_ptr + out, tl.min(tl.where(best == largest, best_index, 2147483647), axis=0))
        tl.store(nan_ptr + out, tl.min(first_nan, axis=0))
        tl.store(sum_ptr + out, tl.sum(lane_sums, axis=0))

    @triton.jit
    def argmax_logsumexp_kernel(max_ptr, index_ptr, nan_ptr, sum_ptr, tokens_ptr, lse_ptr, PARTS,
                                BLOCK: tl.constexpr):
        """torch.argmax (the first maximum; the first NaN if any) and torch.logsumexp of a row
        from its chunks' parts (chunks hold ascending indices: the first chunk at the maximum
        holds its first index)."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < PARTS
        at = row * PARTS + offs
        maxima = tl.load(max_ptr + at, mask=mask, other=float("-inf"))
        largest = tl.max(maxima, axis=0)
        token = tl.min(tl.load(index_ptr + at, mask=mask & (maxima == largest),
                               other=2147483647), axis=0)
        nan_index = tl.min(tl.load(nan_ptr + at, mask=mask, other=2147483647), axis=0)
        finite = (largest > float("-inf")) & (largest < float("inf"))
        sums = tl.load(sum_ptr + at, mask=mask, other=0.0)
        scaled = tl.where(maxima > float("-inf"), sums * tl.exp(maxima - largest), 0.0)
        lse = tl.where(finite, largest + tl.log(tl.sum(scaled, axis=0)), largest)
        has_nan = nan_index < 2147483647
        tl.store(tokens_ptr + row, tl.where(has_nan, nan_index, token).to(tl.int64))
        tl.store(lse_ptr + row, tl.where(has_nan, float("nan"), lse))

    return triton, {"rms_norm": rms_norm_kernel, "act_and_mul": act_and_mul_kernel,
                    "rotary": rotary_kernel, "write_kv": write_kv_kernel,
                    "argmax_logsumexp_part": argmax_logsumexp_part_kernel,
                    "argmax_logsumexp": argmax_logsumexp_kernel}


def _rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be 2-D [rows, features] float with contiguous features, "
                         f"got {tuple(x.shape)} {x.dtype} strides {x.stride()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, offset: bool = False) -> torch.Tensor:
    """norm(x) for x [rows, H]; with `residual` [rows, H]: residual += x (in place) first, and
    the sum is normalised."""
    _rows(x, "rms_norm: x")
    if residual is not None:
        _rows(residual, "rms_norm: residual")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("rms_norm: residual must match x")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: weight must be [{x.shape[1]}] of x's dtype")
    triton, kernels = _kernels()
    out = torch.empty_like(x)
    block = triton.next_power_of_2(x.shape[1])
    if x.shape[0]:
        kernels["rms_norm"][(x.shape[0],)](
            x, weight, residual if residual is not None else x, out, x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0), x.shape[1],
            float(eps), HAS_RESIDUAL=residual is not None, OFFSET=bool(offset), BLOCK=block,
            num_warps=min(16, max(4, block // 512)), **UNFUSED)
    return out


def act_and_mul(x: torch.Tensor, activation: int) -> torch.Tensor:
    """act(gate) * up for x [rows, 2I] = [gate | up] -> [rows, I]."""
    _rows(x, "act_and_mul: x")
    if activation not in ACTIVATIONS or x.shape[1] % 2:
        raise ValueError(f"act_and_mul: activation must be 0 (silu) or 1 (gelu tanh) and x's "
                         f"width even, got {activation} and {x.shape[1]}")
    triton, kernels = _kernels()
    width = x.shape[1] // 2
    out = torch.empty((x.shape[0], width), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    if x.shape[0]:
        kernels["act_and_mul"][(x.shape[0], triton.cdiv(width, block))](
            x, out, width, x.stride(0), out.stride(0), ACTIVATION=activation, BLOCK=block,
            **UNFUSED)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates the first rotary_dim features of x [T, H, D] in place (rotate-half); cos, sin
    [T, rotary_dim] of x's dtype."""
    if x.dim() != 3 or x.stride(2) != 1 or cos.shape != sin.shape or cos.dim() != 2 or (
            cos.shape[0] != x.shape[0] or cos.shape[1] % 2 or cos.shape[1] > x.shape[2]
            or cos.stride(1) != 1 or sin.stride(1) != 1):
        raise ValueError(f"rotary_: x [T, H, D] and cos, sin [T, rotary_dim] expected, got "
                         f"{tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    triton, kernels = _kernels()
    half = cos.shape[1] // 2
    if x.shape[0] and x.shape[1]:
        kernels["rotary"][(x.shape[0], x.shape[1])](
            x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), half,
            BLOCK=triton.next_power_of_2(half), **UNFUSED)


def write_kv_(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, rows: torch.Tensor) -> None:
    """Each (token, kv head) row of k and v [N, Hkv, D] into its cache row `rows` [N * Hkv] of
    the caches viewed as [R, D]."""
    if (k.dim() != 3 or v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1
            or key_cache.shape != value_cache.shape or key_cache.dim() != 2
            or key_cache.shape[1] != k.shape[2] or not key_cache.is_contiguous()
            or not value_cache.is_contiguous() or key_cache.dtype != k.dtype
            or v.dtype != k.dtype or rows.dtype != torch.int64
            or rows.numel() != k.shape[0] * k.shape[1]):
        raise ValueError(f"write_kv_: caches [R, D] of k's dtype, k, v [N, Hkv, D] and rows "
                         f"[N * Hkv] int64 expected, got {tuple(key_cache.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(rows.shape)} {rows.dtype}")
    triton, kernels = _kernels()
    if rows.numel():
        kernels["write_kv"][(rows.numel(),)](
            key_cache, value_cache, k, v, rows.contiguous(), k.shape[1], k.shape[2],
            key_cache.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            BLOCK=triton.next_power_of_2(k.shape[2]))


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.argmax and torch.logsumexp (float32) of each row of logits [S, V], in one pass."""
    _rows(logits, "argmax_logsumexp: logits")
    triton, kernels = _kernels()
    rows = logits.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:  # a row's chunks in parallel: one program scanning a 128k vocabulary took 85 us
        vocab = logits.shape[1]
        parts = triton.cdiv(vocab, ARGMAX_CHUNK)
        maxima, sums = (torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
                        for _ in range(2))
        indices, nans = (torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
                         for _ in range(2))
        kernels["argmax_logsumexp_part"][(rows, parts)](
            logits, maxima, indices, nans, sums, vocab, logits.stride(0), parts,
            CHUNK=ARGMAX_CHUNK, BLOCK=1024)
        kernels["argmax_logsumexp"][(rows,)](maxima, indices, nans, sums, tokens, lse, parts,
                                             BLOCK=triton.next_power_of_2(parts))
    return tokens, lse
