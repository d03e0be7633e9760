"""Reading a Hugging Face model directory (config.json, safetensors or, if trusted, pickle weights)."""
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .architectures import Shapes, lookup
from .errors import ConversionError
from .hf_config import source_dtype
from .sources import Source


def read_json(path: Path) -> dict:
    """A JSON file's contents; ConversionError if it does not parse."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None


def _weight_files(directory: Path, kind: str, pattern: str) -> list[Path]:
    """Weight shards named by the index file when there is one (repos may hold other copies), else by glob."""
    index = directory / f"{kind}.index.json"
    if index.is_file():
        names = dict.fromkeys(read_json(index).get("weight_map", {}).values())
        return [directory / name for name in names]
    return sorted(directory.glob(pattern))


class HFSource(Source):
    """A Hugging Face model directory."""

    def __init__(self, directory: Path, trust_pickle: bool):
        self.directory = directory
        if not (directory / "config.json").is_file():
            raise ConversionError(f"{directory} has no config.json, so it is not a Hugging Face model directory")
        self.raw_config = read_json(directory / "config.json")
        lookup(self.raw_config)
        self.stored_dtype = source_dtype(self.raw_config)
        self._shapes: Shapes = {}
        self._holders: dict[str, object] = {}  # tensor name -> open safetensors file or state dict
        safetensors = _weight_files(directory, "model.safetensors", "*.safetensors")
        pickles = _weight_files(directory, "pytorch_model.bin", "pytorch_model*.bin")
        if safetensors:
            self._open_safetensors(safetensors)
        elif pickles and not trust_pickle:
            raise ConversionError(f"{directory} has only pickle weights ({pickles[0].name}); pickle files can "
                                  "run code when loaded, so pass --trust-pickle if you trust them")
        elif pickles:
            self._open_pickles(pickles)
        else:
            raise ConversionError(f"{directory} has no *.safetensors (or pytorch_model*.bin) weight files")

    def _open_safetensors(self, files: list[Path]) -> None:
        for path in files:
            try:
                handle = safe_open(path, framework="pt")
                for name in handle.keys():
                    self._shapes[name] = tuple(handle.get_slice(name).get_shape())
                    self._holders[name] = handle
            except (OSError, SafetensorError) as e:
                raise ConversionError(f"cannot read {path}: {e}") from None

    def _open_pickles(self, files: list[Path]) -> None:
        for path in files:
            try:
                state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
            except Exception as e:  # unpickling can fail in arbitrary ways
                raise ConversionError(f"cannot load {path}: {e}") from None
            for name, tensor in state.items():
                self._shapes[name] = tuple(tensor.shape)
                self._holders[name] = state

    def tensor_shapes(self) -> Shapes:
        """Every tensor in the weight files, in file order."""
        return dict(self._shapes)

    def load(self, name: str) -> torch.Tensor:
        """One tensor as stored."""
        holder = self._holders[name]
        return holder[name] if isinstance(holder, dict) else holder.get_tensor(name)

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer saved in the directory."""
        try:
            return AutoTokenizer.from_pretrained(self.directory)
        except (OSError, ValueError) as e:
            raise ConversionError(f"cannot load the tokenizer of {self.directory}: {e}") from None

    def generation_config(self) -> dict:
        """The directory's generation_config.json, else the config's special token ids."""
        path = self.directory / "generation_config.json"
        return read_json(path) if path.is_file() else super().generation_config()
