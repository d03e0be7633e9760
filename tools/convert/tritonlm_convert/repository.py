"""Writing the Triton model directory REPO/NAME: config.pbtxt and version 1 (model.py, engine.json, weights/)."""
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase
from tritonlm.config import WEIGHTS_DIR, EngineConfig
from tritonlm.models.loader import Shard, cut_shard

from .errors import ConversionError
from .safetensors_writer import write_safetensors
from .sources import Source

VERSION = "1"
MODEL_PY = ('"""Triton Python-backend entry point of a tritonlm model."""\n'
            "from tritonlm.triton.adapter import TritonPythonModel  # noqa: F401\n")


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def _special_tokens_added(tokenizer: PreTrainedTokenizerBase) -> tuple[bool, bool]:
    """Whether encoding prepends BOS / appends EOS, observed rather than read from flags that may be stale."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    add_bos = start > 0 and full[0] == tokenizer.bos_token_id
    add_eos = len(full) > start + len(plain) and full[-1] == tokenizer.eos_token_id
    return add_bos, add_eos


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """tokenizer.json, tokenizer_config.json (chat template and add_bos/eos flags inline), special_tokens_map.json."""
    tokenizer.save_pretrained(directory, save_jinja_files=False)
    if not (directory / "tokenizer.json").is_file():
        raise ConversionError("the tokenizer could not be saved as a fast tokenizer (tokenizer.json)")
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["add_bos_token"], config["add_eos_token"] = _special_tokens_added(tokenizer)
    _write_json(config_path, config)
    _write_json(directory / "special_tokens_map.json", tokenizer.special_tokens_map)


def _swap_in(staged: Path, target: Path) -> None:
    """Replace directory `target` by `staged`; the old contents (stale files included) are deleted."""
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        os.rename(target, old)
    os.rename(staged, target)
    shutil.rmtree(old, ignore_errors=True)


def _write_rank(path: Path, source: Source, shards: dict[str, Shard], dtype: torch.dtype) -> None:
    """One rank's file: its slice of each tensor, read from the source one tensor at a time, in
    the model dtype unless the source gives the tensor's own (quantized values, their scales)."""
    shapes = source.tensor_shapes()
    local = {}
    for name, shard in shards.items():
        shape = list(shapes[name])
        if shard is not None:
            shape[shard[0]] = len(shard[1])
        local[name] = tuple(shape), source.tensor_dtype(name) or dtype
    write_safetensors(path, local, lambda name: cut_shard(source.load(name), shards[name]))


def write_model(model_dir: Path, source: Source, tokenizer: PreTrainedTokenizerBase, config: dict,
                ranks: list[dict[str, Shard]], engine: EngineConfig, config_pbtxt: str) -> None:
    """Write REPO/NAME, building version 1 in a hidden staging directory and swapping it in when complete."""
    model_dir.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{VERSION}.staging-", dir=model_dir))
    try:
        staged.chmod(0o755)  # mkdtemp makes it private; the server may run as another user
        weights = staged / WEIGHTS_DIR
        weights.mkdir()
        save_tokenizer(tokenizer, weights)
        _write_json(weights / "config.json", config)
        _write_json(weights / "generation_config.json", source.generation_config())
        for rank, shards in enumerate(ranks):
            _write_rank(weights / f"rank{rank}.safetensors", source, shards,
                        getattr(torch, config["torch_dtype"]))
        engine.save(staged)
        (staged / "model.py").write_text(MODEL_PY)
        _swap_in(staged, model_dir / VERSION)
        pbtxt_tmp = model_dir / "config.pbtxt.tmp"
        pbtxt_tmp.write_text(config_pbtxt)
        os.replace(pbtxt_tmp, model_dir / "config.pbtxt")
    finally:
        shutil.rmtree(staged, ignore_errors=True)
