"""The model runner's side of multi-LoRA: every adapter's weights for this rank, kept on the host,
the `max_loras` slots of the layers they update, which adapter sits in which slot (least
recently used goes first), and each step's token -> slot mask (layers/lora.py)."""
import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from tritonlm.engine.lora_registry import LoRAAdapter
from tritonlm.engine.step_plan import ScheduledChunk
from tritonlm.layers.lora import LayerLoRA, LoRABatch
from tritonlm.models.lora_loader import load_adapter, part_columns, rank_dim

logger = logging.getLogger(__name__)


class LoRASlots:
    def __init__(self, model: nn.Module, adapters: list[LoRAAdapter], num_slots: int,
                 max_rank: int, device: torch.device):
        self.num_slots, self.device = num_slots, device
        self.host = {a.lora_id: load_adapter(model, a, max_rank) for a in adapters}
        self.batch = LoRABatch()
        self.layers: dict[str, LayerLoRA] = {}
        for path in sorted({p for weights in self.host.values() for p in weights}):
            layer = model.get_submodule(path)
            layer.lora = LayerLoRA(self.batch, num_slots, rank_dim(model, path, max_rank),
                                   layer.in_features, layer.out_features,
                                   part_columns(model, path), device)
            self.layers[path] = layer.lora
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora_id -> slot, least recent first
        # (rows, keep, counts) kept per width for CPU op programs, which replay the same tensors
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        logger.info("LoRA: %d adapters (%s) over %d layers, %d slots of rank %d",
                    len(adapters), ", ".join(a.name for a in adapters), len(self.layers),
                    num_slots, max_rank)

    def prepare(self, chunks: list[ScheduledChunk], width: int | None = None) -> bool:
        """Put this step's adapters in slots and group its tokens by slot; whether any token
        uses an adapter. `width`: tokens per slot to allow for, in tensors kept for that width
        (a recorded op program's step), else just enough."""
        ids = [chunk.lora_id for chunk in chunks]
        wanted = list(dict.fromkeys(i for i in ids if i))
        if not wanted:
            self.batch.rows = self.batch.keep = self.batch.counts = None
            return False
        if len(wanted) > self.num_slots:
            raise RuntimeError(f"a step of {len(wanted)} adapters, over max_loras ({self.num_slots})")
        for lora_id in wanted:
            self._make_resident(lora_id, wanted)
        slot_of_chunk = [self.resident[i] if i else -1 for i in ids]
        slots = np.repeat(slot_of_chunk, [len(c.token_ids) for c in chunks])
        # tokens grouped by slot, each group padded to the largest: rows[slot, position]
        tokens = np.argsort(slots, kind="stable")
        tokens = tokens[slots[tokens] >= 0]
        counts = np.bincount(slots[tokens], minlength=self.num_slots)
        position = np.arange(len(tokens)) - (np.cumsum(counts) - counts)[slots[tokens]]
        rows = np.zeros((self.num_slots, width or counts.max()), dtype=np.int64)
        keep = np.zeros((self.num_slots, width or counts.max(), 1), dtype=np.float32)
        rows[slots[tokens], position] = tokens
        keep[slots[tokens], position] = 1
        arrays = (rows, keep, counts.astype(np.int64))
        if width is None:
            self.batch.rows, self.batch.keep = (torch.from_numpy(a).to(self.device)
                                                for a in arrays[:2])
            self.batch.counts = torch.from_numpy(arrays[2])
        else:
            kept = self._kept.setdefault(width, tuple(torch.from_numpy(a) for a in arrays))
            for tensor, array in zip(kept, arrays):
                tensor.copy_(torch.from_numpy(array))
            self.batch.rows, self.batch.keep, self.batch.counts = kept
        return True

    def _make_resident(self, lora_id: int, wanted: list[int]) -> None:
        if lora_id in self.resident:
            self.resident.move_to_end(lora_id)
            return
        taken = set(self.resident.values())
        free = [s for s in range(self.num_slots) if s not in taken]
        if free:
            slot = free[0]
        else:
            evicted = next(i for i in self.resident if i not in wanted)
            slot = self.resident.pop(evicted)
        weights = self.host[lora_id]
        for path, layer in self.layers.items():
            layer.load(slot, *weights.get(path, (None, None)))
        self.resident[lora_id] = slot
