"""PEFT LoRA adapters onto a built model's parallel linear layers: which layer (and which part of
a fused one) each adapter module updates, and this tensor-parallel rank's slice of its weights,
laid out as layers/lora.py holds them."""
import re

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tritonlm.engine.lora_registry import ADAPTER_WEIGHTS, LoRAAdapter
from tritonlm.layers.linear import _ShardedLinear
from tritonlm.models.loader import _checkpoint_names

# base_model.model.<module>.lora_A.weight (older PEFT versions keep the adapter's name before
# .weight)
_PEFT_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])(\.[^.]+)?\.weight")

LayerWeights = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer path -> (A (R, in), B (R, out))


def lora_targets(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """Each Hugging Face linear module the model computes -> (our layer's path, its part in the
    layer, the layer's number of parts)."""
    packed = getattr(model, "packed_modules", {})
    targets = {}
    for path, module in model.named_modules():
        if isinstance(module, _ShardedLinear):
            names = _checkpoint_names(f"{path}.weight", packed)
            for part, name in enumerate(names):
                targets[name.removesuffix(".weight")] = (path, part, len(names))
    return targets


def num_parts(model: nn.Module, path: str) -> int:
    """The checkpoint modules a layer is made of (3 for q/k/v fused from separate ones)."""
    return len(_checkpoint_names(f"{path}.weight", getattr(model, "packed_modules", {})))


def part_sizes(layer: _ShardedLinear, parts: int) -> list[int]:
    """The full output features of each of a layer's `parts` checkpoint modules (a layer fused
    in the checkpoint itself, as GPT-BigCode's c_attn, is one)."""
    return layer.part_sizes if len(layer.part_sizes) == parts else [layer.full_features[1]]


def rank_dim(model: nn.Module, path: str, max_rank: int) -> int:
    """The rows of a layer's slots: max_rank for each of its parts."""
    return max_rank * num_parts(model, path)


def part_columns(model: nn.Module, path: str) -> list[int]:
    """Where each checkpoint part of a layer starts in this rank's outputs, then their end."""
    layer = model.get_submodule(path)
    sizes = part_sizes(layer, num_parts(model, path))
    if layer.shard_dim == 1:  # row-parallel: every output
        return [0, layer.out_features]
    bounds = np.cumsum([0, *sizes])
    return np.searchsorted(layer.shard_index, bounds).tolist()


def load_adapter(model: nn.Module, adapter: LoRAAdapter, max_rank: int) -> LayerWeights:
    """This rank's weights of `adapter` for every layer it updates, alpha / r folded into B;
    ValueError naming what does not fit the model (a module it lacks, another base model's
    shapes)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    path = adapter.path / ADAPTER_WEIGHTS
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                match = _PEFT_KEY.fullmatch(key)
                if match is None:
                    raise ValueError(f"{key} is not a LoRA weight (lora_A / lora_B)")
                halves.setdefault(match["module"], {})[match["half"]] = f.get_tensor(key).float()
    except (ValueError, SafetensorError) as exc:
        raise ValueError(f"LoRA adapter {adapter.name!r}: {path}: {exc}") from None
    targets = lora_targets(model)
    lacking = sorted(m for m in halves if m not in targets)
    if lacking:
        raise ValueError(f"LoRA adapter {adapter.name!r} targets {', '.join(lacking[:3])}"
                         f"{' and more' if len(lacking) > 3 else ''}: no linear layer of this "
                         f"{type(model).__name__} (another model family?)")
    weights: LayerWeights = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {adapter.name!r}: {module} lacks lora_"
                             f"{({'A', 'B'} - set(pair)).pop()}")
        layer_path, part, parts = targets[module]
        layer = model.get_submodule(layer_path)
        a, b = _full_rows(adapter, module, layer, part, parts, pair["A"], pair["B"], max_rank)
        if layer_path in weights:
            a, b = a + weights[layer_path][0], b + weights[layer_path][1]
        weights[layer_path] = (a, b)
    return {p: _this_rank(model.get_submodule(p), a, b) for p, (a, b) in weights.items()}


def _full_rows(adapter: LoRAAdapter, module: str, layer: _ShardedLinear, part: int,
               parts: int, a: torch.Tensor, b: torch.Tensor,
               max_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A module's (A, B) placed in its layer's full (parts * max_rank, in) and (.., out)."""
    full_in, full_out = layer.full_features
    sizes = part_sizes(layer, parts)
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, full_in) \
            or tuple(b.shape) != (sizes[part], rank):
        raise ValueError(f"LoRA adapter {adapter.name!r}: {module} has lora_A {list(a.shape)} "
                         f"and lora_B {list(b.shape)}, but this model's layer takes {full_in} "
                         f"inputs to {sizes[part]} outputs (an adapter of another base model?)")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {adapter.name!r}: {module} has rank {rank}, over "
                         f"max_lora_rank ({max_rank})")
    rows = slice(part * max_rank, part * max_rank + rank)
    offset = sum(sizes[:part])
    full_a = torch.zeros(parts * max_rank, full_in)
    full_b = torch.zeros(parts * max_rank, full_out)
    full_a[rows] = a
    full_b[rows, offset:offset + sizes[part]] = (b * adapter.scale(module, rank)).T
    return full_a, full_b


def _this_rank(layer: _ShardedLinear, a: torch.Tensor, b: torch.Tensor):
    index = torch.from_numpy(layer.shard_index)
    if layer.shard_dim == 0:  # outputs split: B's columns
        return a, b.index_select(1, index).contiguous()
    return a.index_select(1, index).contiguous(), b
