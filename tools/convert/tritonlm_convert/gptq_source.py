"""Reading GPTQ checkpoints (AutoGPTQ, GPTQModel) as tritonlm's quantized storage.

Per quantized linear X the checkpoint holds `X.qweight` (int32 [in * bits / 32, out], values
packed along the input dimension, low bits first), `X.qzeros` (int32 [groups, out * bits / 32],
packed along the output dimension), `X.scales` ([groups, out]) and `X.g_idx` (int32 [in]), and
w[o, i] = scale[g, o] * (q[i, o] - zero[g, o]) with g = g_idx[i]. The classic format ("gptq",
v1) stores (zero - 1) mod 2^bits, GPTQModel's "gptq_v2" the zero itself.

They become `X.quantized.*` (layers/quantization.py: w = q * scale + bias), exactly:
- 4 bits: q as stored (0..15), bias = -zero * scale.
- 8 bits: our q is signed, so q - 128 is stored and bias = (128 - zero) * scale.
Both are exact in float32 (q, zero < 2^9 times an fp16 scale), so the weights served equal the
checkpoint's own dequantization. A quantized head (GPTQModel's lm_head=True) stays quantized.
"""
from pathlib import Path

import torch
from tritonlm.layers.quantization import QUANTIZED, pack_int4

from .architectures import Shapes
from .errors import ConversionError
from .hf_source import HFSource, read_json

ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}  # checkpoint format -> what is added to a stored zero
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
SIGNED_SHIFT = {4: 0, 8: 128}  # our stored q = GPTQ's q - shift


def gptq_settings(directory: Path, raw_config: dict) -> dict | None:
    """The checkpoint's GPTQ settings (config.json `quantization_config`, else the older
    quantize_config.json), or None when it is not a GPTQ checkpoint."""
    settings = raw_config.get("quantization_config")
    if settings is None and (directory / "quantize_config.json").is_file():
        settings = read_json(directory / "quantize_config.json")
    if settings is None or settings.get("quant_method", "gptq") != "gptq":
        return None
    return settings


def is_gptq_checkpoint(directory: Path) -> bool:
    config = directory / "config.json"
    return config.is_file() and gptq_settings(directory, read_json(config)) is not None


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] -> int32 [..., n * 32 / bits], each word's values low bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & (2 ** bits - 1)).flatten(-2)


def _checked_settings(settings: dict) -> tuple[int, int, int]:
    """(bits, group size, zero offset); ConversionError for what tritonlm cannot serve."""
    bits, group_size = settings.get("bits"), settings.get("group_size", -1)
    checkpoint_format = settings.get("checkpoint_format") or settings.get("format") or "gptq"
    if bits not in SIGNED_SHIFT:
        raise ConversionError(f"GPTQ checkpoints with {bits} bits are not supported (4 or 8 are)")
    if checkpoint_format not in ZERO_OFFSETS or settings.get("is_marlin_format"):
        raise ConversionError(f"GPTQ checkpoint format {checkpoint_format!r} is not supported "
                              f"(only {' and '.join(ZERO_OFFSETS)}, not repacked kernel layouts)")
    if settings.get("pack_dtype", "int32") not in ("int32", None):
        raise ConversionError(f"GPTQ weights packed in {settings['pack_dtype']} are not supported")
    if any({"bits", "group_size"} & set(rule) for rule in (settings.get("dynamic") or {}).values()):
        raise ConversionError("GPTQ checkpoints with per-module bits or group sizes are not supported")
    return bits, group_size, ZERO_OFFSETS[checkpoint_format]


class GPTQSource(HFSource):
    """A Hugging Face directory of GPTQ-quantized weights, read as tritonlm quantized tensors.
    The layout-specific parts (`_settings`, `_linear_shape`, `_values`, `_zeros_and_scales`,
    `_g_idx`) are methods, which AWQSource (awq_source.py) overrides."""
    method = "gptq"

    def __init__(self, directory: Path, trust_pickle: bool = False):
        super().__init__(directory, trust_pickle)
        self.bits, self.group_size, self.zero_offset = self._settings(directory)
        self.quantization = f"{self.method}-int{self.bits}"
        # The files written are not in GPTQ layout, so transformers must not be told they are.
        self.raw_config = {k: v for k, v in self.raw_config.items() if k != "quantization_config"}
        stored = self._shapes
        self._exposed: Shapes = {}
        for name, shape in stored.items():
            module, _, leaf = name.rpartition(".")
            if f"{module}.qweight" not in stored:
                self._exposed[name] = shape
            elif leaf == "qweight":
                self._expose_linear(module, stored)
            elif leaf not in GPTQ_TENSORS:  # the linear's float bias
                self._exposed[name] = shape

    def _settings(self, directory: Path) -> tuple[int, int, int]:
        """(bits, group size, zero offset) of the checkpoint."""
        settings = gptq_settings(directory, self.raw_config)
        if settings is None:
            raise ConversionError(f"{directory} is not a GPTQ checkpoint")
        return _checked_settings(settings)

    def _linear_shape(self, module: str, stored: Shapes) -> tuple[int, int, int]:
        """(in features, out features, groups) of a quantized linear, its tensors checked."""
        packed_in, out_features = stored[f"{module}.qweight"]
        in_features = packed_in * 32 // self.bits
        groups = stored[f"{module}.scales"][0]
        if stored[f"{module}.qzeros"] != (groups, out_features * self.bits // 32) \
                or stored[f"{module}.scales"][1] != out_features \
                or stored.get(f"{module}.g_idx", (in_features,)) != (in_features,):
            raise ConversionError(f"the GPTQ tensors of {module} have inconsistent shapes")
        return in_features, out_features, groups

    def _expose_linear(self, module: str, stored: Shapes) -> None:
        in_features, out_features, groups = self._linear_shape(module, stored)
        quantized = f"{module}.{QUANTIZED}"
        self._exposed[f"{quantized}.qweight"] = (
            out_features, in_features // 2 if self.bits == 4 else in_features)
        self._exposed[f"{quantized}.scales"] = (out_features, groups)
        self._exposed[f"{quantized}.biases"] = (out_features, groups)
        self._exposed[f"{quantized}.g_idx"] = (in_features,)

    def tensor_shapes(self) -> Shapes:
        """The checkpoint's tensors with each quantized linear under tritonlm's names."""
        return dict(self._exposed)

    def tensor_dtype(self, name: str) -> torch.dtype | None:
        """The dtype quantized tensors keep; None for float tensors (cast to the engine dtype)."""
        module, quantized, leaf = name.partition(f".{QUANTIZED}.")
        if not quantized:
            return None
        return {"qweight": torch.uint8 if self.bits == 4 else torch.int8, "scales": torch.float32,
                "biases": torch.float32, "g_idx": torch.int32}[leaf]

    def load(self, name: str) -> torch.Tensor:
        module, quantized, leaf = name.partition(f".{QUANTIZED}.")
        if quantized:
            return self._quantized(module, leaf)
        return super().load(name)

    def _stored(self, name: str) -> torch.Tensor:
        """A tensor as the checkpoint holds it."""
        return HFSource.load(self, name)

    def _values(self, module: str) -> torch.Tensor:
        """The unsigned quantized values, int32 [out, in]."""
        return unpack_int32(self._stored(f"{module}.qweight").T, self.bits)

    def _zeros_and_scales(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [out, groups] each."""
        zeros = unpack_int32(self._stored(f"{module}.qzeros"), self.bits)
        zeros = (zeros + self.zero_offset) & (2 ** self.bits - 1)  # v1 stored a zero of 0 as -1
        return zeros.T.float(), self._stored(f"{module}.scales").T.float()

    def _g_idx(self, module: str) -> torch.Tensor:
        in_features = self._shapes[f"{module}.qweight"][0] * 32 // self.bits
        groups = self._shapes[f"{module}.scales"][0]
        if f"{module}.g_idx" in self._shapes:
            g_idx = self._stored(f"{module}.g_idx").to(torch.int32)
        else:  # GPTQModel may leave out the plain column // group_size
            size = self.group_size if self.group_size > 0 else in_features
            g_idx = torch.arange(in_features, dtype=torch.int32) // size
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise ConversionError(f"{module}.g_idx names groups outside its {groups} scales")
        return g_idx

    def _quantized(self, module: str, leaf: str) -> torch.Tensor:
        shift = SIGNED_SHIFT[self.bits]
        if leaf == "qweight":
            values = self._values(module)
            return pack_int4(values) if self.bits == 4 else (values - shift).to(torch.int8)
        if leaf == "g_idx":
            return self._g_idx(module)
        zeros, scales = self._zeros_and_scales(module)
        return scales if leaf == "scales" else (shift - zeros) * scales
