"""Random LoRA adapters for a benchmark: PEFT's file layout, every linear layer the model computes,
the rank asked for; their weights only need to be finite (the figures are speeds)."""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tritonlm.config import WEIGHTS_DIR, linked_repository
from tritonlm.engine.lora_registry import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MULTI_LORA_FILE
from tritonlm.models.loader import build_model, load_config
from tritonlm.models.lora_loader import lora_targets, part_sizes


def adapter_names(count: int) -> list[str]:
    return [f"lora{i}" for i in range(count)]


def with_random_adapters(version_dir: Path, directory: Path, count: int, rank: int) -> Path:
    """A repository serving `version_dir`'s weights (linked) with `count` random adapters of
    `rank`; returns its model directory."""
    model = build_model(load_config(version_dir / WEIGHTS_DIR), 1)
    modules = {}
    for module, (path, part, parts) in lora_targets(model).items():
        layer = model.get_submodule(path)
        modules[module] = (layer.full_features[0], part_sizes(layer, parts)[part])
    generator = torch.Generator().manual_seed(0)
    repository = linked_repository(version_dir.parent, directory, max_loras=max(4, count))
    version = repository / "llm" / "1"
    listed = {}
    for name in adapter_names(count):
        adapter = version / "loras" / name
        adapter.mkdir(parents=True)
        weights = {}
        for module, (inputs, outputs) in modules.items():
            prefix = f"base_model.model.{module}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, inputs, generator=generator) / inputs ** 0.5
            weights[f"{prefix}.lora_B.weight"] = torch.randn(outputs, rank, generator=generator) * 0.01
        save_file(weights, adapter / ADAPTER_WEIGHTS)
        targets = sorted({m.rpartition(".")[2] for m in modules})
        (adapter / ADAPTER_CONFIG).write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets}))
        listed[name] = f"loras/{name}"
    (version / MULTI_LORA_FILE).write_text(json.dumps(listed))
    return repository / "llm"
