"""LoRA adapters in a converted model version: each PEFT directory copied to loras/NAME and
listed in multi_lora.json (Triton vllm_backend's convention), after checking that it fits the
model; the engine picks them up when the model (re)loads."""
import json
import os
import re
import shutil
from pathlib import Path

from tritonlm.config import WEIGHTS_DIR, EngineConfig
from tritonlm.engine.lora_registry import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, MULTI_LORA_FILE,
                                           check_rank, read_adapter)

from .errors import ConversionError

LORA_DIR = "loras"


def parse_lora(text: str) -> tuple[str, Path]:
    """NAME=PATH -> (name, path); the name becomes a directory and a client-facing model id."""
    name, sep, path = text.partition("=")
    if not sep or not path or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise ConversionError(f"a LoRA adapter is NAME=PATH with a plain name, got {text!r}")
    return name, Path(path)


def latest_version(model_dir: Path) -> Path:
    versions = sorted((p for p in Path(model_dir).iterdir()
                       if p.name.isdigit() and (p / WEIGHTS_DIR).is_dir()), key=lambda p: int(p.name))
    if not versions:
        raise ConversionError(f"{model_dir} holds no converted model version")
    return versions[-1]


def add_loras(version_dir: Path, adapters: list[tuple[str, Path]]) -> None:
    """Copy each adapter into `version_dir` and list it (a name given again is replaced)."""
    listed_path = version_dir / MULTI_LORA_FILE
    listed = json.loads(listed_path.read_text()) if listed_path.exists() else {}
    max_rank = EngineConfig.load(version_dir).max_lora_rank
    for name, source in adapters:
        _check_fits(version_dir, name, source, max_rank)
        target = version_dir / LORA_DIR / name
        staged = target.with_name(f".{name}.staging-{os.getpid()}")
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copyfile(source / file, staged / file)
        shutil.rmtree(target, ignore_errors=True)
        os.rename(staged, target)
        listed[name] = f"{LORA_DIR}/{name}"
    staged_list = listed_path.with_suffix(".json.tmp")
    staged_list.write_text(json.dumps(listed, indent=2) + "\n")
    os.replace(staged_list, listed_path)


def _check_fits(version_dir: Path, name: str, source: Path, max_rank: int | None) -> None:
    """The adapter's settings and every weight against the model built (without weights)."""
    from tritonlm.models.loader import build_model, load_config
    from tritonlm.models.lora_loader import load_adapter
    try:
        adapter = read_adapter(1, name, source)
        check_rank(adapter, max_rank)
        load_adapter(build_model(load_config(version_dir / WEIGHTS_DIR), 1), adapter,
                     adapter.max_rank)
    except (ValueError, KeyError, OSError) as error:
        raise ConversionError(str(error)) from None
