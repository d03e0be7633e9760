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
    expected = model.state_dict().keys()
    state = {}
    with safe_open(weights_dir / f"rank{rank}.safetensors", framework="pt") as f:
        available = set(f.keys())
        missing = [name for name in expected if name not in available]
        if missing:
            raise ValueError(f"weights missing from {weights_dir}: {missing[:5]}...")
        for name in expected:
            state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True, strict=True)
    return model.to(device).eval()
