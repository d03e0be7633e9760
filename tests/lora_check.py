"""Random PEFT LoRA adapters on tiny transformers models, and their reference: greedy tokens of
the `peft` library's merged model in transformers."""
import json
from pathlib import Path

import torch

from family_check import reference_greedy


def save_adapter(base_dir: Path, model_class, out: Path, seed: int, **lora) -> Path:
    """A random (not zero-initialised) adapter over the model saved in `base_dir`."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = model_class.from_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():  # PEFT's non-zero init is small: make the adapter change the output
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(20)
    peft_model.save_pretrained(out)
    return out


def merged_greedy(base_dir: Path, model_class, adapter_dir: Path, prompts, new_tokens: int):
    from peft import PeftModel
    model = model_class.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
    return [reference_greedy(merged, p, new_tokens) for p in prompts]


def register(model_dir: Path, adapters: dict[str, Path]) -> None:
    """List adapters in a converted model version's multi_lora.json."""
    version = next(p for p in model_dir.iterdir() if p.name.isdigit())
    (version / "multi_lora.json").write_text(
        json.dumps({name: str(path) for name, path in adapters.items()}))
