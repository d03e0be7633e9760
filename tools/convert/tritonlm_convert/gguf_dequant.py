"""Vectorized numpy dequantizers for the GGML tensor types found in GGUF files, and the
unpacking of the 32-element block types the engine's quantized storage holds as they are."""
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from .errors import ConversionError

# Block layouts of the ggml formats (ggml-common.h); "qs" holds packed quants, "qh" the 5th bits.
_BLOCKS = {
    T.Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
    T.Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    T.Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    T.Q5_0: np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)]),
    T.Q5_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)]),
    T.Q4_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)]),
    T.Q5_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", 32),
                      ("qs", "u1", 128)]),
    T.Q6_K: np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")]),
}


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Low nibbles of a 16-byte run are elements 0-15, high nibbles elements 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of the 32-bit qh word is the 5th bit of element j."""
    return ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q8_0(b):
    return _f32(b["d"])[:, None] * _f32(b["qs"])


def _q4_0(b):
    return _f32(b["d"])[:, None] * (_f32(_nibbles(b["qs"])) - 8)


def _q4_1(b):
    return _f32(b["d"])[:, None] * _f32(_nibbles(b["qs"])) + _f32(b["m"])[:, None]


def _q5_0(b):
    q = _nibbles(b["qs"]) | (_fifth_bits(b["qh"]) << 4)
    return _f32(b["d"])[:, None] * (_f32(q) - 16)


def _q5_1(b):
    q = _nibbles(b["qs"]) | (_fifth_bits(b["qh"]) << 4)
    return _f32(b["d"])[:, None] * _f32(q) + _f32(b["m"])[:, None]


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the eight 6-bit (scale, min) pairs of a Q4_K/Q5_K super-block."""
    lo, hi, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo & 0x3F, (extra & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([hi & 0x3F, (extra >> 4) | ((hi >> 6) << 4)], axis=-1)
    return _f32(scales), _f32(mins)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: each 32-byte run holds two 32-element sub-blocks (low, then high nibbles)."""
    runs = qs.reshape(-1, 4, 1, 32)
    return ((runs >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F).reshape(-1, 8, 32)


def _k_apply(b, q: np.ndarray) -> np.ndarray:
    scales, mins = _k_scales_mins(b["scales"])
    d = (_f32(b["d"])[:, None] * scales)[..., None]
    m = (_f32(b["dmin"])[:, None] * mins)[..., None]
    return (d * _f32(q) - m).reshape(-1, 256)


def _q4_k(b):
    return _k_apply(b, _k_low_nibbles(b["qs"]))


def _q5_k(b):
    # Bit s of qh[l] is the 5th bit of element l of sub-block s.
    high = (b["qh"][:, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return _k_apply(b, _k_low_nibbles(b["qs"]) | (high << 4))


def _q6_k(b):
    ql = b["ql"].reshape(-1, 2, 64)  # two halves of 128 elements
    qh = b["qh"].reshape(-1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(-1, 2, 128)
    q = (_f32(low | (high << 4)) - 32).reshape(-1, 16, 16)  # one int8 scale per 16 elements
    return (_f32(b["d"])[:, None, None] * _f32(b["scales"])[..., None] * q).reshape(-1, 256)


_BLOCK_DEQUANTIZERS = {
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
    T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}
_FLOAT_TYPES = {T.F32: "<f4", T.F16: "<f2", T.BF16: "<u2"}
SUPPORTED_TYPES = (*_FLOAT_TYPES, *_BLOCK_DEQUANTIZERS)


def check_supported(qtype: T, tensor_name: str = "") -> None:
    """Raise ConversionError if tensors of this GGML type cannot be dequantized."""
    if qtype not in SUPPORTED_TYPES:
        where = f" (tensor {tensor_name})" if tensor_name else ""
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ConversionError(f"unsupported GGUF tensor type {T(qtype).name}{where}; supported: {names}")


def _checked_bytes(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    if raw.size * block_size != int(np.prod(shape)) * block_bytes:
        raise ConversionError(f"{T(qtype).name} tensor of shape {shape} has {raw.size} bytes")
    return raw


# Block types whose values are w = d * q + bias in groups of 32, like the engine's storage.
KEPT_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1)
KEPT_GROUP_SIZE = 32


def block_values(raw: np.ndarray, qtype: T, shape: tuple[int, int]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A Q8_0/Q4_0/Q4_1 matrix [rows, cols] as its values q (int8, or uint8 in 0..15), and per
    block of 32 columns its scale d and bias [rows, cols / 32] (Q8_0: none), so w = q * d + bias."""
    rows, cols = shape
    blocks = _checked_bytes(raw, qtype, shape).view(_BLOCKS[qtype])
    scales = _f32(blocks["d"]).reshape(rows, cols // KEPT_GROUP_SIZE)
    if qtype == T.Q8_0:
        return np.array(blocks["qs"]).reshape(rows, cols), scales, None
    values = _nibbles(blocks["qs"]).reshape(rows, cols)
    biases = -8 * scales if qtype == T.Q4_0 else _f32(blocks["m"]).reshape(scales.shape)
    return values, scales, biases


def dequantize(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize the raw bytes of one GGUF tensor into a float32 array of `shape` (row-major)."""
    check_supported(qtype)
    raw = _checked_bytes(raw, qtype, shape)
    if qtype == T.BF16:
        values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif qtype in _FLOAT_TYPES:
        values = raw.view(_FLOAT_TYPES[qtype]).astype(np.float32)
    else:
        values = _BLOCK_DEQUANTIZERS[qtype](raw.view(_BLOCKS[qtype]))
    return values.reshape(shape)
