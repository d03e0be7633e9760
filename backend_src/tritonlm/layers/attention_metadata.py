"""Per-step attention inputs, built once with numpy and shared by every layer."""
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class EncoderBatch:
    """Encoder-decoder models: the prompts to encode this step, padded to the longest."""
    input_ids: torch.Tensor  # [B, S]
    valid: torch.Tensor  # [B, S] bool
    write_rows: torch.Tensor  # where the N valid tokens' cross-attention K/V go (write_locations)


@dataclass
class DecodeRows:
    """Rows with a single query token (decodes). The PyTorch path gathers their K/V padded to
    the longest of them (rows of similar context lengths are grouped, not padded to the batch's
    longest) and masks; a decode kernel reads the blocks in place up to each row's context."""
    token_index: torch.Tensor  # [Bd]
    blocks: torch.Tensor  # [Bd, Hkv, nb] rows of the [blocks * Hkv, bs, D] view
    mask: torch.Tensor | None = None  # [Bd, 1, nb * bs, 1], True where a key is visible
    distance: torch.Tensor | None = None  # [Bd, nb * bs] key minus query position
    context_lens: torch.Tensor | None = None  # [Bd] keys per row, for a decode kernel


@dataclass
class PrefillRows:
    """Rows with several query tokens, for the CPU kernel, which reads their blocks in place:
    row b's queries are the tokens query_starts[b] .. + query_lens[b], the last positions of its
    context_lens[b] keys."""
    query_starts: torch.Tensor  # [Bp]
    query_lens: torch.Tensor  # [Bp]
    context_lens: torch.Tensor  # [Bp]
    blocks: torch.Tensor  # [Bp, Hkv, nb] rows of the [blocks * Hkv, bs, D] view


@dataclass
class AttentionMetadata:
    """Where this step's K/V go in the cache and which cached tokens each query sees."""
    # PyTorch backend: rows of the cache viewed [num_blocks * Hkv * bs, D] for each new (token, head).
    write_rows: torch.Tensor | None = None  # [T * Hkv]
    # Per token: its row's key count once this step's tokens are in (dynamic NTK rotary).
    seq_lens: torch.Tensor | None = None  # [T]
    # Rows with a single query token (decodes), grouped by context length.
    decode: "list[DecodeRows]" = field(default_factory=list)
    # Rows with several query tokens (prefill chunks): for the CPU kernel, or padded to the
    # longest for SDPA.
    prefill_rows: PrefillRows | None = None
    prefill_token_index: torch.Tensor | None = None  # [Bp, Qp]
    prefill_token_valid: torch.Tensor | None = None  # [Bp, Qp]
    prefill_blocks: torch.Tensor | None = None  # [Bp, Hkv, nb]
    prefill_mask: torch.Tensor | None = None  # [Bp, 1, Qp, nb * bs]
    prefill_distance: torch.Tensor | None = None  # [Bp, Qp, nb * bs]
    # flash-attn backend
    slot_mapping: torch.Tensor | None = None  # [T]
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    # Encoder-decoder models: the decoder's view of the encoder output, and what to encode.
    cross: "AttentionMetadata | None" = None
    encoder: EncoderBatch | None = None
    # The same step for layers with another sliding window, by window.
    by_window: "dict[int | None, AttentionMetadata]" = field(default_factory=dict)


@dataclass
class StepLayout:
    """A step's chunks as numpy arrays: one row per scheduled sequence."""
    lens: np.ndarray  # new tokens per row
    starts: np.ndarray  # tokens already in the cache per row
    first: np.ndarray  # index of each row's first token in the flat token array
    positions: np.ndarray  # [T]
    tables: np.ndarray  # [B, max_blocks] block tables, zero-padded
    block_size: int
    kv_lens: np.ndarray | None = None  # keys per row, when not starts + lens (cross-attention)

    @property
    def context(self) -> np.ndarray:
        return self.starts + self.lens if self.kv_lens is None else self.kv_lens


@dataclass(frozen=True)
class AttentionSpec:
    """What every attention layer of one kind (self or cross) needs from the metadata."""
    num_kv_heads: int
    sliding_window: int | None = None  # a query sees keys less than this many positions back
    needs_distances: bool = False  # position-dependent score biases (ALiBi, T5 buckets)
    causal: bool = True  # False: cross-attention, every key of the row visible, nothing written


def build_metadata(layout: StepLayout, spec: AttentionSpec, use_flash: bool,
                   to_tensor: Callable[[np.ndarray], torch.Tensor],
                   decode_kernel: bool = False, prefill_kernel: bool = False) -> AttentionMetadata:
    """`decode_kernel`: decode rows are for a paged decode kernel (blocks and context lengths);
    `prefill_kernel`: so are causal rows of several queries, for the CPU prefill kernel
    (layers/attention.py's PagedKernels)."""
    seq_lens = to_tensor(np.repeat(layout.context, layout.lens))
    if use_flash:
        meta = _flash_metadata(layout, spec, to_tensor)
        meta.seq_lens = seq_lens
        return meta
    heads = np.arange(spec.num_kv_heads)
    meta = AttentionMetadata(seq_lens=seq_lens)
    if spec.causal:
        meta.write_rows = to_tensor(write_locations(layout.tables, layout.lens, layout.positions,
                                                    layout.block_size, spec.num_kv_heads, False))
    context = layout.context
    decode = layout.lens == 1
    decode_rows = np.flatnonzero(decode)
    if decode_kernel and len(decode_rows):
        meta.decode.append(DecodeRows(to_tensor(layout.first[decode_rows]),
                                      to_tensor(_context_blocks(layout, decode_rows, heads)[0]),
                                      context_lens=to_tensor(context[decode_rows])))
    for rows in [] if decode_kernel else _length_groups(decode_rows, context):
        blocks, keys = _context_blocks(layout, rows, heads)
        query_pos = layout.starts[rows][:, None]  # [Bd, 1]
        distance = keys[None, :] - query_pos
        visible = _visible(distance, keys[None, :] < context[rows][:, None], spec)
        meta.decode.append(DecodeRows(
            to_tensor(layout.first[rows]), to_tensor(blocks), to_tensor(visible[:, None, :, None]),
            to_tensor(distance) if spec.needs_distances else None))
    prefill = ~decode
    if prefill.any() and prefill_kernel and spec.causal:
        rows = np.flatnonzero(prefill)
        meta.prefill_rows = PrefillRows(
            to_tensor(layout.first[rows]), to_tensor(layout.lens[rows]), to_tensor(context[rows]),
            to_tensor(_context_blocks(layout, rows, heads)[0]))
    elif prefill.any():
        blocks, keys = _context_blocks(layout, prefill, heads)
        q = np.arange(int(layout.lens[prefill].max()))
        valid = q[None, :] < layout.lens[prefill][:, None]
        query_pos = layout.starts[prefill][:, None] + q[None, :]
        distance = keys[None, None, :] - query_pos[:, :, None]  # [Bp, Qp, L]
        in_context = (keys[None, None, :] < context[prefill][:, None, None]) & valid[:, :, None]
        meta.prefill_token_index = to_tensor(np.where(valid, layout.first[prefill][:, None] + q, 0))
        meta.prefill_token_valid = to_tensor(valid)
        meta.prefill_blocks = to_tensor(blocks)
        visible = _visible(distance, in_context, spec)
        visible[..., 0] |= ~valid  # padded query rows see key 0, so no softmax row is empty
        meta.prefill_mask = to_tensor(visible[:, None, :, :])
        if spec.needs_distances:
            meta.prefill_distance = to_tensor(distance)
    return meta


def _length_groups(rows: np.ndarray, context: np.ndarray, max_groups: int = 4,
                   min_rows: int = 8) -> list[np.ndarray]:
    """Decode rows in batch order, or split by context length into up to `max_groups` groups
    when that cuts the padded K/V the step gathers by a quarter or more."""
    if len(rows) == 0:
        return []
    groups = np.array_split(rows[np.argsort(context[rows], kind="stable")],
                            min(max_groups, max(1, len(rows) // min_rows)))

    def padded(group):
        return len(group) * int(context[group].max())
    if len(groups) == 1 or sum(padded(g) for g in groups) > 0.75 * padded(rows):
        return [rows]
    return groups


def write_locations(tables: np.ndarray, lens: np.ndarray, positions: np.ndarray, block_size: int,
                    num_kv_heads: int, use_flash: bool) -> np.ndarray:
    """Where each new token's K/V go: flash-attn, its slot in the [num_blocks * bs, Hkv, D] view;
    PyTorch, the rows of the [num_blocks * Hkv * bs, D] view for each (token, kv head)."""
    row = np.repeat(np.arange(len(lens)), lens)
    block = tables[row, positions // block_size]
    offset = positions % block_size
    if use_flash:
        return block * block_size + offset
    heads = np.arange(num_kv_heads)
    return ((block[:, None] * num_kv_heads + heads) * block_size + offset[:, None]).reshape(-1)


def _visible(distance: np.ndarray, in_context: np.ndarray, spec: AttentionSpec) -> np.ndarray:
    """Keys of the row's context; for self-attention, at or before the query and in its window."""
    if not spec.causal:
        return in_context
    visible = in_context & (distance <= 0)
    if spec.sliding_window is not None:
        visible &= distance > -spec.sliding_window
    return visible


def _context_blocks(layout: StepLayout, rows: np.ndarray, heads: np.ndarray):
    """(block, head) rows covering the selected rows' contexts, and the key positions they hold."""
    num_blocks = -(-int(layout.context[rows].max()) // layout.block_size)
    tables = layout.tables[rows, :num_blocks]
    blocks = tables[:, None, :] * len(heads) + heads[None, :, None]
    return blocks, np.arange(num_blocks * layout.block_size)


def _flash_metadata(layout: StepLayout, spec: AttentionSpec, to_tensor) -> AttentionMetadata:
    def cumulative(x):
        return to_tensor(np.concatenate(([0], np.cumsum(x))).astype(np.int32))
    meta = AttentionMetadata(
        cu_seqlens_q=cumulative(layout.lens), cu_seqlens_k=cumulative(layout.context),
        max_seqlen_q=int(layout.lens.max()), max_seqlen_k=int(layout.context.max()),
        block_tables=to_tensor(layout.tables.astype(np.int32)))
    if spec.causal:
        meta.slot_mapping = to_tensor(write_locations(layout.tables, layout.lens, layout.positions,
                                                      layout.block_size, spec.num_kv_heads, True))
    return meta
