"""Paged attention: K/V live in fixed-size blocks of one preallocated cache, found via block tables.

Cache layout per layer, by backend:
- PyTorch: [num_blocks, num_kv_heads, block_size, head_dim]. Gathering whole (block, head) rows
  of the [num_blocks * Hkv, block_size, D] view gives each sequence's keys as a contiguous
  [Hkv, L, D] tensor: large copies, and no transpose before the matmuls.
- flash-attn: [num_blocks, block_size, num_kv_heads, head_dim], its paged layout.
An int8 cache (layers/kv_cache.py) is dequantized as it is gathered, and holds K/V rotated:
queries are rotated into its basis and outputs back. flash-attn cannot read it.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tritonlm.layers.attention_metadata import AttentionMetadata, DecodeRows
from tritonlm.layers.kv_cache import LayerKV

try:  # flash-attn is an optional GPU extra
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None

# flash-attn's paged kernels need pages of a multiple of 256 tokens.
FLASH_BLOCK_MULTIPLE = 256


def flash_attention_usable(device: torch.device, dtype: torch.dtype, block_size: int,
                           kv_cache_dtype: str) -> bool:
    """Whether flash-attn can run; an int8 KV cache takes the PyTorch path, which dequantizes."""
    return (flash_attn_varlen_func is not None and device.type == "cuda"
            and kv_cache_dtype == "auto" and dtype in (torch.float16, torch.bfloat16)
            and block_size % FLASH_BLOCK_MULTIPLE == 0)


def cache_block_shape(block_size: int, num_kv_heads: int, head_dim: int, use_flash: bool):
    if use_flash:
        return block_size, num_kv_heads, head_dim
    return num_kv_heads, block_size, head_dim


@dataclass(frozen=True)
class PagedKernels:
    """Kernels that read K/V where they lie in the paged cache, picked per device by the model
    runner, with the CPU kernels' arguments (layers/cpu_kernels.py): `decode` for rows of one
    query (the C++ kernel, or on CUDA the Triton one), `prefill` for causal rows of several
    (C++ only). None: that part takes the PyTorch path."""
    decode: Callable | None = None
    prefill: Callable | None = None


class PagedAttention(nn.Module):
    """Attention over the paged cache. Self-attention (causal) writes this step's K/V and attends;
    cross-attention (causal=False) attends to K/V written once by `write` when the encoder ran.
    `position_bias`, when given, maps key-minus-query distances [..., L] to additive score biases
    [..., H, L] (ALiBi, T5's relative buckets). Layers with the same `kv_slot` share one cache
    slice (a decoder layer's self- and cross-attention, whose blocks never overlap)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, position_bias=None, causal: bool = True,
                 kv_slot: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.position_bias = position_bias
        self.causal = causal
        self.kv_slot = kv_slot
        self.use_flash = False
        self.kernels = PagedKernels()  # set by the model runner
        # Assigned by the model runner once the cache is allocated.
        self.kv = LayerKV(torch.empty(0), torch.empty(0))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k and v: [T, Hkv, D] for this step's tokens; returns [T, Hq, D]."""
        self.write(k, v, meta.slot_mapping if self.use_flash else meta.write_rows)
        return self.attend(q, meta.by_window.get(self.sliding_window, meta))

    def write(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """Store K/V [N, Hkv, D] at cache rows (flash: slots) [N * Hkv] (flash: [N])."""
        self.kv.write(k, v, rows, self.num_kv_heads * self.head_dim if self.use_flash
                      else self.head_dim)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.use_flash:
            return self._flash(q, meta)
        q = self.kv.rotate(q)
        prefill = meta.prefill_rows is not None or meta.prefill_token_index is not None
        if not prefill and len(meta.decode) == 1:
            return self.kv.unrotate(self._decode(q, meta.decode[0]))  # token i is row i
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for rows in meta.decode:
            out[rows.token_index] = self._decode(q[rows.token_index], rows)
        if meta.prefill_rows is not None:  # the kernel writes its rows' tokens of `out`
            rows = meta.prefill_rows
            block_size, head_dim = self.kv.key.shape[-2:]
            self.kernels.prefill(
                q.contiguous(), self.kv.key.view(-1, block_size, head_dim),
                self.kv.value.view(-1, block_size, head_dim), rows.blocks, rows.query_starts,
                rows.query_lens, rows.context_lens, self.scale,
                getattr(self.position_bias, "slopes", None), self.sliding_window or 0, out)
        elif meta.prefill_token_index is not None:
            q_rows = q[meta.prefill_token_index]  # [Bp, Qp, Hq, D]
            # Rows for every query head: CUDA's memory-efficient SDPA takes a mask but not
            # enable_gqa, which would leave the math kernel (every score materialized).
            group = self.num_heads // self.num_kv_heads
            keys, values = self.kv.gather(meta.prefill_blocks.repeat_interleave(group, 1), q.dtype)
            mask = meta.prefill_mask
            if self.position_bias is not None:  # [Bp, Qp, H, L] -> [Bp, H, Qp, L]
                bias = self.position_bias(meta.prefill_distance).transpose(1, 2)
                mask = bias.masked_fill(~mask, float("-inf")).to(q.dtype)
            o = F.scaled_dot_product_attention(q_rows.transpose(1, 2), keys, values,
                                               attn_mask=mask, scale=self.scale).transpose(1, 2)
            valid = meta.prefill_token_valid
            out[meta.prefill_token_index[valid]] = o[valid]
        return self.kv.unrotate(out)

    def _decode(self, q: torch.Tensor, decode: DecodeRows) -> torch.Tensor:
        if decode.context_lens is not None:  # the kernel reads the blocks where they are
            block_size, head_dim = self.kv.key.shape[-2:]
            return self.kernels.decode(  # q's rows may lie apart (a fused qkv's query part)
                q, self.kv.key.view(-1, block_size, head_dim),
                self.kv.value.view(-1, block_size, head_dim), decode.blocks, decode.context_lens,
                self.scale, getattr(self.position_bias, "slopes", None), self.sliding_window or 0)
        # One query per row: two batched matmuls beat SDPA's CPU kernels (bf16 most of all).
        rows, group = q.shape[0], self.num_heads // self.num_kv_heads
        keys, values = self.kv.gather(decode.blocks, q.dtype)
        q = q.view(rows, self.num_kv_heads, group, self.head_dim)
        # keys @ q^T keeps the large operand untransposed (a transposed one is copied on CPU).
        scores = torch.matmul(keys, q.transpose(-1, -2)).float() * self.scale  # [B, Hkv, L, G]
        if self.position_bias is not None:  # [B, H, L] -> [B, Hkv, L, G]
            bias = self.position_bias(decode.distance)
            scores += bias.view(rows, self.num_kv_heads, group, -1).transpose(-1, -2)
        scores.masked_fill_(~decode.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-2).to(q.dtype)
        out = torch.matmul(probs.transpose(-1, -2), values)  # [B, Hkv, G, D]
        return out.view(rows, self.num_heads, self.head_dim)

    def _flash(self, q, meta: AttentionMetadata) -> torch.Tensor:
        return flash_attn_varlen_func(
            q, self.kv.key, self.kv.value, meta.cu_seqlens_q, meta.cu_seqlens_k,
            meta.max_seqlen_q, meta.max_seqlen_k, softmax_scale=self.scale, causal=self.causal,
            window_size=(self.sliding_window - 1 if self.sliding_window else -1, 0),
            alibi_slopes=getattr(self.position_bias, "slopes", None), block_table=meta.block_tables)
