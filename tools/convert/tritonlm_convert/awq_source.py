"""Reading AutoAWQ GEMM checkpoints (LMDeploy's and vLLM's "awq" W4A16) as tritonlm's quantized
storage, through GPTQSource's pipeline with AWQ's layout.

Per quantized linear X: `X.qweight` int32 [in, out / 8], 4-bit values packed along the OUTPUT
dimension, nibble i of a word holding column 8k + [0, 2, 4, 6, 1, 3, 5, 7][i]; `X.qzeros` int32
[groups, out / 8] packed the same way; `X.scales` fp16 [groups, out]; no g_idx (group = input //
group_size). w[i, o] = (q[i, o] - zero[g, o]) * scale[g, o], stored transposed against
nn.Linear. The zero is stored as it is (no GPTQ v1 offset).
"""
from pathlib import Path

import torch

from .architectures import Shapes
from .errors import ConversionError
from .gptq_source import GPTQSource, unpack_int32

AWQ_UNPACK = [0, 4, 1, 5, 2, 6, 3, 7]  # column 8k + j sits in nibble AWQ_UNPACK[j]


def _columns_in_order(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, n / 8] packed the AWQ way -> int32 [rows, n] in column order."""
    values = unpack_int32(packed, 4)
    return values.view(values.shape[0], -1, 8)[:, :, AWQ_UNPACK].reshape(values.shape[0], -1)


class AWQSource(GPTQSource):
    method = "awq"

    def _settings(self, directory: Path) -> tuple[int, int, int]:
        settings = self.raw_config.get("quantization_config") or {}
        if settings.get("quant_method") != "awq":
            raise ConversionError(f"{directory} is not an AWQ checkpoint")
        version = str(settings.get("version", "gemm")).lower()
        if settings.get("bits", settings.get("w_bit")) != 4 or version != "gemm" \
                or not settings.get("zero_point", True):
            raise ConversionError(
                f"AWQ checkpoints of 4 bits with zero points in the GEMM layout are supported; "
                f"this one has bits {settings.get('bits')}, version {version!r}, zero_point "
                f"{settings.get('zero_point', True)}")
        group_size = settings.get("group_size", settings.get("q_group_size", -1))
        return 4, group_size, 0

    def _linear_shape(self, module: str, stored: Shapes) -> tuple[int, int, int]:
        in_features, packed_out = stored[f"{module}.qweight"]
        out_features = packed_out * 8
        groups = stored[f"{module}.scales"][0]
        size = self.group_size if self.group_size > 0 else in_features
        if stored[f"{module}.qzeros"] != (groups, packed_out) \
                or stored[f"{module}.scales"] != (groups, out_features) \
                or groups != -(-in_features // size):
            raise ConversionError(f"the AWQ tensors of {module} have inconsistent shapes")
        return in_features, out_features, groups

    def _values(self, module: str) -> torch.Tensor:
        return _columns_in_order(self._stored(f"{module}.qweight")).T

    def _zeros_and_scales(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = _columns_in_order(self._stored(f"{module}.qzeros"))
        return zeros.T.float(), self._stored(f"{module}.scales").T.float()

    def _g_idx(self, module: str) -> torch.Tensor:
        in_features = self._shapes[f"{module}.qweight"][0]
        size = self.group_size if self.group_size > 0 else in_features
        return torch.arange(in_features, dtype=torch.int32) // size
