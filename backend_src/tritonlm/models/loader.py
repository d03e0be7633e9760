"""Builds a model on the meta device and assigns its weights from this rank's safetensors file."""
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from tritonlm.models.registry import model_class


def load_config(weights_dir: Path):
    return AutoConfig.from_pretrained(weights_dir)


def load_model(weights_dir: Path, config, dtype: torch.dtype, device: torch.device,
               max_positions: int, rank: int = 0) -> nn.Module:
    """The model for `config` with weights from `rank{rank}.safetensors`, in eval mode."""
    with torch.device("meta"):
        model = model_class(config)(config, max_positions)
    packed = getattr(model, "packed_modules", {})
    state = {}
    with safe_open(weights_dir / f"rank{rank}.safetensors", framework="pt") as f:
        available = set(f.keys())
        for name in model.state_dict():
            sources = _checkpoint_names(name, packed)
            missing = [s for s in sources if s not in available]
            if missing:
                raise ValueError(f"weights missing from {weights_dir}: {missing}")
            tensor = torch.cat([f.get_tensor(s) for s in sources]) if len(sources) > 1 \
                else f.get_tensor(sources[0])
            state[name] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True, strict=True)
    return model.to(device).eval()


def _checkpoint_names(name: str, packed: dict[str, tuple[str, ...]]) -> list[str]:
    """The checkpoint tensors a parameter is made of: itself, or the parts of a fused module."""
    *path, module, leaf = name.split(".")
    parts = packed.get(module)
    if parts is None:
        return [name]
    return [".".join([*path, part, leaf]) for part in parts]
