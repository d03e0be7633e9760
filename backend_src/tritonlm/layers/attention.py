"""Paged attention: K/V live in fixed-size blocks of one preallocated cache, found via block tables.

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] (flash-attn's paged layout).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

try:  # flash-attn is an optional GPU extra
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None

# flash-attn's paged kernels need pages of a multiple of 256 tokens.
FLASH_BLOCK_MULTIPLE = 256


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and which cached tokens each query sees."""
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    # Rows with a single query token (decodes); their context is gathered from the cache.
    decode_token_index: torch.Tensor | None = None  # [Bd]
    decode_slots: torch.Tensor | None = None  # [Bd, Ld]
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, Ld]
    # Rows with several query tokens (prefill chunks), padded to the longest.
    prefill_token_index: torch.Tensor | None = None  # [Bp, Qp]
    prefill_token_valid: torch.Tensor | None = None  # [Bp, Qp]
    prefill_slots: torch.Tensor | None = None  # [Bp, Lp]
    prefill_mask: torch.Tensor | None = None  # [Bp, 1, Qp, Lp]
    # flash-attn varlen inputs (set only when that backend is used)
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32


def flash_attention_usable(device: torch.device, dtype: torch.dtype, block_size: int) -> bool:
    return (flash_attn_varlen_func is not None and device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16) and block_size % FLASH_BLOCK_MULTIPLE == 0)


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.use_flash = False
        # Assigned by the model runner once the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k and v: [T, Hkv, D] for this step's tokens; returns [T, Hq, D]."""
        k_flat = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
        if self.use_flash:
            return flash_attn_varlen_func(
                q, self.k_cache, self.v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k,
                meta.max_seqlen_q, meta.max_seqlen_k, softmax_scale=self.scale, causal=True,
                block_table=meta.block_tables)
        out = torch.empty_like(q)
        if meta.decode_token_index is not None:
            q_rows = q[meta.decode_token_index].unsqueeze(1)  # [Bd, 1, Hq, D]
            o = self._attend(q_rows, k_flat, v_flat, meta.decode_slots, meta.decode_mask)
            out[meta.decode_token_index] = o.squeeze(1)
        if meta.prefill_token_index is not None:
            q_rows = q[meta.prefill_token_index]  # [Bp, Qp, Hq, D]
            o = self._attend(q_rows, k_flat, v_flat, meta.prefill_slots, meta.prefill_mask)
            valid = meta.prefill_token_valid
            out[meta.prefill_token_index[valid]] = o[valid]
        return out

    def _attend(self, q_rows, k_flat, v_flat, slots, mask) -> torch.Tensor:
        keys = k_flat[slots].to(q_rows.dtype).transpose(1, 2)  # [B, Hkv, L, D]
        values = v_flat[slots].to(q_rows.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(q_rows.transpose(1, 2), keys, values, attn_mask=mask,
                                           scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2)  # [B, Q, Hq, D]
