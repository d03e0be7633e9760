"""Turns a StepPlan's chunks into the model's inputs: token ids, positions, attention metadata."""
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from tritonlm.engine.step_plan import ScheduledChunk
from tritonlm.layers.attention_metadata import (AttentionMetadata, AttentionSpec, EncoderBatch,
                                                StepLayout, build_metadata, write_locations)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_index: torch.Tensor  # the token whose hidden state each sampling chunk samples from


class StepInputBuilder:
    def __init__(self, block_size: int, self_specs: list[AttentionSpec],
                 cross_specs: list[AttentionSpec], use_flash: bool, device: torch.device,
                 decode_kernel: bool = False, prefill_kernel: bool = False):
        self.block_size = block_size
        # Layers with another sliding window (Qwen2's, Gemma 2's mixes) get masks of their own.
        self.self_spec, *self.window_specs = self_specs
        self.cross_spec = cross_specs[0] if cross_specs else None
        self.use_flash = use_flash
        # which rows' attention runs in paged kernels (layers/attention.py's PagedKernels)
        self.kernels = {"decode_kernel": decode_kernel, "prefill_kernel": prefill_kernel}
        self.device = device

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def build(self, chunks: list[ScheduledChunk]) -> StepInputs:
        lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
        starts = np.array([c.start_pos for c in chunks], dtype=np.int64)
        ends = np.cumsum(lens)
        first = ends - lens
        input_ids = _flat([c.token_ids for c in chunks])
        positions = np.repeat(starts - first, lens) + np.arange(int(ends[-1]))
        layout = StepLayout(lens, starts, first, positions,
                            pad_tables([c.block_table for c in chunks]), self.block_size)
        meta = build_metadata(layout, self.self_spec, self.use_flash, self._tensor,
                              **self.kernels)
        meta.by_window = {spec.sliding_window: build_metadata(layout, spec, self.use_flash,
                                                             self._tensor, **self.kernels)
                          for spec in self.window_specs}
        if self.cross_spec is not None:
            self._add_encoder_inputs(chunks, layout, meta)
        sample_index = np.array([e - 1 for c, e in zip(chunks, ends) if c.sampling is not None],
                                dtype=np.int64)
        return StepInputs(self._tensor(input_ids), self._tensor(positions), meta,
                          self._tensor(sample_index))

    def _add_encoder_inputs(self, chunks: list[ScheduledChunk], layout: StepLayout,
                            meta: AttentionMetadata) -> None:
        cross_tables = pad_tables([c.cross_block_table for c in chunks])
        encoder_lens = np.array([c.encoder_len for c in chunks], dtype=np.int64)
        cross = StepLayout(layout.lens, np.zeros_like(layout.starts), layout.first,
                           layout.positions, cross_tables, self.block_size, kv_lens=encoder_lens)
        meta.cross = build_metadata(cross, self.cross_spec, self.use_flash, self._tensor,
                                    **self.kernels)
        encoding = [i for i, c in enumerate(chunks) if c.encoder_token_ids is not None]
        if not encoding:
            return
        lens = encoder_lens[encoding]
        width = int(lens.max())
        valid = np.arange(width)[None, :] < lens[:, None]
        ids = np.zeros(valid.shape, dtype=np.int64)
        ids[valid] = _flat([chunks[i].encoder_token_ids for i in encoding])
        positions = np.concatenate([np.arange(n) for n in lens])
        rows = write_locations(cross_tables[encoding], lens, positions, self.block_size,
                               self.cross_spec.num_kv_heads, self.use_flash)
        meta.encoder = EncoderBatch(self._tensor(ids), self._tensor(valid), self._tensor(rows))


def _flat(lists: list[list[int]]) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64,
                       count=sum(len(x) for x in lists))


def pad_tables(tables: list[list[int]], width: int | None = None, fill: int = 0) -> np.ndarray:
    """Block tables as one [B, width] array (width: the longest table's), padded with `fill`."""
    lens = np.array([len(t) for t in tables], dtype=np.int64)
    width = width or max(int(lens.max()), 1)
    out = np.full((len(tables), width), fill, dtype=np.int64)
    out[np.arange(width)[None, :] < lens[:, None]] = _flat(tables)
    return out
