"""Streaming a safetensors file one tensor at a time, so a conversion holds one tensor in memory."""
import json
import math
import struct
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from .errors import ConversionError

_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32"}


def write_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                      load: Callable[[str], torch.Tensor]) -> None:
    """Write the tensors named in `tensors` (name -> shape and dtype, fetched with `load`) to a
    safetensors file. Float tensors are cast to their dtype; any other must already have it."""
    header, offset = {}, 0
    for name, (shape, dtype) in tensors.items():
        end = offset + math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, (shape, dtype) in tqdm(tensors.items(), desc="Converting", unit="tensor"):
            tensor = load(name)
            if tensor.dtype != dtype and not (tensor.is_floating_point() and dtype.is_floating_point):
                raise ConversionError(f"tensor {name} is {tensor.dtype}, expected {dtype}")
            if tuple(tensor.shape) != shape:
                raise ConversionError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")
            f.write(tensor.to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy().data)
