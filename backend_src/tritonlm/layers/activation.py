"""Activations by Hugging Face `hidden_act` name, and their codes in the fused CPU kernel
(csrc/fused_ops.cpp's act_and_mul)."""
import torch.nn.functional as F


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
}

FUSED_CODES = {"silu": 0, "swish": 0, "gelu_new": 1, "gelu_fast": 1, "gelu_pytorch_tanh": 1}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; known: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]
