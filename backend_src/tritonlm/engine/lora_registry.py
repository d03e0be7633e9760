"""The fine-tuned adapters a model version serves: `multi_lora.json` in the version directory
(Triton vllm_backend's convention, {"name": "path"}, a path inside the version directory,
relative to it: a repository cannot make the server read elsewhere), each a PEFT LoRA directory (`adapter_config.json`, `adapter_model.safetensors`).
Names map to ids 1.. (0 is the base model) in the file's order."""
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

MULTI_LORA_FILE = "multi_lora.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRAAdapter:
    lora_id: int
    name: str
    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)

    def scale(self, module: str, rank: int) -> float:
        """What the update B @ A of `module` (a PEFT module name, e.g. model.layers.0.
        self_attn.q_proj) is multiplied by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        alpha = next((value for key, value in self.alpha_pattern.items()
                      if re.match(rf"(.*\.)?{key}$", module)), self.alpha)
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)

    def module_rank(self, module: str) -> int:
        return next((value for key, value in self.rank_pattern.items()
                     if re.match(rf"(.*\.)?{key}$", module)), self.rank)

    @property
    def max_rank(self) -> int:
        return max([self.rank, *self.rank_pattern.values()])


def read_adapter(lora_id: int, name: str, path: Path) -> LoRAAdapter:
    """An adapter's settings; ValueError for what tritonlm cannot serve."""
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"LoRA adapter {name!r}: {path} lacks {ADAPTER_CONFIG} or "
                         f"{ADAPTER_WEIGHTS} (a PEFT save_pretrained directory)")
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: {path / ADAPTER_CONFIG}: {exc}") from None
    unsupported = [what for what, present in (
        (f"peft_type {config.get('peft_type')}", config.get("peft_type", "LORA") != "LORA"),
        ("DoRA (use_dora)", config.get("use_dora")),
        (f"trained biases (bias={config.get('bias')!r})", config.get("bias", "none") != "none"),
        (f"modules_to_save {config.get('modules_to_save')}", config.get("modules_to_save")),
        ("fan_in_fan_out", config.get("fan_in_fan_out"))) if present]
    if unsupported:
        raise ValueError(f"LoRA adapter {name!r} uses what tritonlm does not serve: "
                         f"{', '.join(unsupported)}")
    return LoRAAdapter(lora_id, name, path, int(config["r"]), float(config["lora_alpha"]),
                       bool(config.get("use_rslora")), dict(config.get("rank_pattern") or {}),
                       dict(config.get("alpha_pattern") or {}))


def read_registry(version_dir: Path, max_lora_rank: int | None) -> list[LoRAAdapter]:
    """The adapters of a model version directory, in id order (none without multi_lora.json)."""
    path = version_dir / MULTI_LORA_FILE
    if not path.exists():
        return []
    try:
        entries = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(entries, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) for k, v in entries.items()):
        raise ValueError(f'{path} must map adapter names to their directories: {{"name": "path"}}')
    adapters = [read_adapter(i, name, _inside(version_dir, name, where))
                for i, (name, where) in enumerate(entries.items(), start=1)]
    for adapter in adapters:
        check_rank(adapter, max_lora_rank)
    return adapters


def _inside(version_dir: Path, name: str, where: str) -> Path:
    path = (version_dir / where).resolve()
    if not path.is_relative_to(version_dir.resolve()):
        raise ValueError(f"LoRA adapter {name!r}: {where} is outside the model version directory "
                         f"{version_dir} (tritonlm-convert --add-lora copies an adapter into it)")
    return path


def check_rank(adapter: LoRAAdapter, max_lora_rank: int | None) -> None:
    if max_lora_rank is not None and adapter.max_rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.max_rank}, over "
                         f"max_lora_rank ({max_lora_rank})")
