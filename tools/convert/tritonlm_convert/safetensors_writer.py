"""Streaming a safetensors file one tensor at a time, so a conversion holds one tensor in memory."""
import json
import math
import struct
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from .errors import ConversionError

_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                      load: Callable[[str], torch.Tensor]) -> None:
    """Write the tensors named in `shapes` (fetched with `load`, cast to `dtype`) to a safetensors file."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header, offset = {}, 0
    for name, shape in shapes.items():
        end = offset + math.prod(shape) * itemsize
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, shape in tqdm(shapes.items(), desc="Converting", unit="tensor"):
            tensor = load(name).to(dtype).contiguous()
            if tuple(tensor.shape) != shape:
                raise ConversionError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
