"""Builds a model on the meta device and assigns its weights from this rank's safetensors file.

Models mirror their Hugging Face module names, so a parameter is read from the checkpoint tensor of
the same name, or, for a fused module listed in the model's `packed_modules`, from its parts
concatenated along the output dimension. The same plan validates a checkpoint at conversion time.
"""
import re
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig

from tritonlm.layers.quantization import QUANTIZED, QuantizedWeight
from tritonlm.models.registry import context_limit, model_class

Shapes = dict[str, tuple[int, ...]]


def load_config(weights_dir: Path):
    return AutoConfig.from_pretrained(weights_dir)


def build_model(config, max_positions: int | None = None) -> nn.Module:
    """The model for `config` on the meta device, without weights."""
    with torch.device("meta"):
        return model_class(config)(config, max_positions or context_limit(config))


def use_quantized_storage(model: nn.Module, found: Shapes) -> None:
    """Give every parallel linear layer whose checkpoint holds quantized tensors (see
    layers/quantization.py) quantized storage of the bits and groups it was saved with; the LM
    head too, when the checkpoint holds it so."""
    packed = getattr(model, "packed_modules", {})
    head = getattr(model, "head_name", None)
    if hasattr(model, "use_quantized_head") and f"{head}.{QUANTIZED}.qweight" in found:
        with torch.device("meta"):
            model.use_quantized_head()
    for path, module in list(model.named_modules()):
        if not hasattr(module, "use_quantized_weight"):
            continue
        first = {leaf: _checkpoint_names(f"{path}.{QUANTIZED}.{leaf}", packed)[0]
                 for leaf in ("qweight", "scales", "biases", "g_idx")}
        qweight = found.get(first["qweight"])
        if qweight is not None:  # g_idx spans the input columns the file holds, as qweight does
            bits = 8 if qweight[1] == found[first["g_idx"]][0] else 4
            with torch.device("meta"):
                module.use_quantized_weight(bits, found[first["scales"]][1],
                                            first["biases"] in found)


def fused_g_idx(model: nn.Module, found: Shapes) -> list[list[str]]:
    """The g_idx tensors of each fused quantized layer's parts, which must be equal: the loader
    reads the first part's alone."""
    packed = getattr(model, "packed_modules", {})
    groups = ([_saved_name(s, found) for s in _checkpoint_names(name, packed)]
              for name in model.state_dict() if name.endswith(".g_idx"))
    return [group for group in groups if len(group) > 1]


def checkpoint_plan(model: nn.Module, found: Shapes) -> dict[str, list[str]]:
    """Parameter name -> the checkpoint tensors it is made of; ValueError naming what does not fit.
    Checkpoint tensors the model does not read must be declared ignorable by it."""
    packed = getattr(model, "packed_modules", {})
    plan, missing, wrong, shared = {}, [], [], []
    for name, param in model.state_dict().items():
        sources = [_saved_name(s, found) for s in _checkpoint_names(name, packed)]
        if name.endswith(".g_idx"):  # fused parts share their input columns: read the first
            shared += sources[1:]
            sources = sources[:1]
        absent = [s for s in sources if s not in found]
        missing += absent
        if not absent and not _fits(tuple(param.shape), [found[s] for s in sources]):
            wrong.append(f"{'+'.join(sources)} {[found[s] for s in sources]} "
                         f"(expected {tuple(param.shape)})")
        plan[name] = sources
    used = {s for sources in plan.values() for s in sources} | set(shared)
    ignored = re.compile(getattr(model, "ignored_checkpoint_tensors", r"$^"))
    head = f"{getattr(model, 'head_name', 'lm_head')}.weight"
    tied_copy = head if head not in plan else None
    unexpected = [k for k in found if k not in used and k != tied_copy and not ignored.fullmatch(k)]
    for problem, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise ValueError(f"{problem} tensors: {', '.join(names[:3])}{more}")
    return plan


Shard = tuple[int, np.ndarray] | None  # (dim, indices) of a checkpoint tensor, or None: whole


def shard_plan(model: nn.Module, plan: dict[str, list[str]], found: Shapes) -> dict[str, Shard]:
    """For a model built as one tensor-parallel rank: how that rank's slice of each checkpoint
    tensor is cut, as its parallel layers say (everything else is replicated)."""
    shards = {}
    for name, sources in plan.items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if hasattr(module, "shard_parts"):
            parts = module.shard_parts(leaf, [found[s][0] for s in sources])
        else:
            parts = [None] * len(sources)
        shards.update(zip(sources, parts))
    return shards


def cut_shard(tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    if shard is None:
        return tensor
    dim, index = shard
    return tensor.index_select(dim, torch.from_numpy(index)).contiguous()


def load_model(weights_dir: Path, config, dtype: torch.dtype, device: torch.device,
               max_positions: int, rank: int = 0) -> nn.Module:
    """The model for `config` with weights from `rank{rank}.safetensors`, in eval mode."""
    model = build_model(config, max_positions)
    state = {}
    path = weights_dir / f"rank{rank}.safetensors"
    try:
        with safe_open(path, framework="pt") as f:
            found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
            use_quantized_storage(model, found)
            plan = checkpoint_plan(model, found)
            for name, sources in plan.items():
                tensor = torch.cat([f.get_tensor(s) for s in sources]) if len(sources) > 1 \
                    else f.get_tensor(sources[0])
                keeps_dtype = not tensor.is_floating_point() or f".{QUANTIZED}." in name
                state[name] = tensor.to(device=device, dtype=None if keeps_dtype else dtype)
    except (ValueError, SafetensorError) as e:  # a plan that does not fit, a malformed file
        raise ValueError(f"{path}: {e}") from None
    model.load_state_dict(state, assign=True, strict=True)
    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            module.rows_dtype = dtype
    return model.to(device).eval()


def _fits(shape: tuple[int, ...], parts: list[tuple[int, ...]]) -> bool:
    if len(parts) == 1:
        return parts[0] == shape
    return (all(p[1:] == shape[1:] for p in parts)
            and sum(p[0] for p in parts) == shape[0])


def _saved_name(name: str, found: Shapes) -> str:
    """Checkpoints saved from the base model (OPT's `decoder.*` for `model.decoder.*`) lack the
    top-level prefix of the causal-LM wrapper."""
    base = name.partition(".")[2]
    return base if name not in found and base in found else name


def _checkpoint_names(name: str, packed: dict[str, tuple[str, ...]]) -> list[str]:
    """The checkpoint tensors a parameter is made of: itself, or the parts of a fused module
    (which may hold the parameter in a submodule, as quantized storage does)."""
    components = name.split(".")
    for i, module in enumerate(components[:-1]):
        if module in packed:
            return [".".join([*components[:i], part, *components[i + 1:]]) for part in packed[module]]
    return [name]
