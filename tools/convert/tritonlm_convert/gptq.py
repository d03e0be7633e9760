"""GPTQ (Frantar et al. 2022): each linear weight is rounded column by column, and each column's
rounding error is spread over the columns not yet rounded through the inverse Hessian of the
layer's output error on calibration inputs, H = 2 X^T X / N. Columns go in decreasing H diagonal
order (act-order; `g_idx` keeps the groups so nothing is reordered at serving time), in blocks
whose updates to the later columns are applied once per block (lazy batch updates).

Layers are quantized one after another (calibration.py), so each Hessian is measured on the
inputs the quantized model will give the layer.

Each group's range is searched (clipping its extremes by up to CLIP_STEPS percent, as GPTQ's
`mse` option does), and its zero point is not rounded: both cut the error of a 4-bit grid.

Output, per weight, is tritonlm's storage (layers/quantization.py): int4 asymmetric (values
0..15 with a float zero point, stored as biases), int8 symmetric (no biases); groups of
`group_size` input columns, or one per output row with -1.
"""
from dataclasses import dataclass
from pathlib import Path

import torch
from tritonlm.layers.quantization import pack_int4

from .calibration import LayerWork, Storage, quantize_layer_by_layer
from .errors import ConversionError

DAMPING = 0.01  # of the Hessian's mean diagonal, added until its Cholesky factorization succeeds
BLOCK_COLUMNS = 128  # columns per lazy batch update
CLIP_STEPS = 40  # clipping ranges tried per group, in steps of 1%


@dataclass(frozen=True)
class Grid:
    """The integers a group of weights rounds to: 0..2^bits-1 around a zero point (not itself
    rounded: the storage keeps float biases), or symmetric around 0."""
    bits: int
    symmetric: bool

    @property
    def levels(self) -> tuple[int, int]:
        half = 2 ** (self.bits - 1)
        return (-half, half - 1) if self.symmetric else (0, 2 ** self.bits - 1)

    def fit(self, weight: torch.Tensor, error=None, clip: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero per row of weight [..., columns] (one group's columns last): of the
        ranges that clip the row's extremes (and 0) by 0 to CLIP_STEPS percent (none when not
        `clip`), the one with the least `error(deviation [..., columns]) -> [...]` (by default
        the squared error of the weights themselves)."""
        error = error or (lambda deviation: deviation.square().sum(-1))
        low, high = self.levels
        if self.symmetric:
            top = weight.abs().amax(-1)
            bottom = -top * (-low / high)
        else:
            bottom, top = weight.amin(-1).clamp(max=0), weight.amax(-1).clamp(min=0)
        best = None
        for shrink in 1 - torch.arange(CLIP_STEPS if clip else 1) / 100:
            scale = (top - bottom) * shrink / (high - low)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            zero = torch.zeros_like(scale) if self.symmetric else low - bottom * shrink / scale
            if not clip:
                return scale, zero
            loss = error(self.fake_quantize(weight, scale, zero) - weight)
            if best is None:
                best = loss, scale, zero
            else:
                better = loss < best[0]
                best = tuple(torch.where(better, new, old) for new, old in zip((loss, scale, zero), best))
        return best[1], best[2]

    def fake_quantize(self, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """weight [..., columns] rounded on the grid of scale and zero [...] and decoded."""
        scale, zero = scale[..., None], zero[..., None]
        return self.dequantize(self.round(weight, scale, zero), scale, zero)

    def round(self, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        low, high = self.levels
        return (torch.round(weight / scale + zero)).clamp(low, high)

    @staticmethod
    def dequantize(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return (values - zero) * scale


@dataclass
class RoundedWeight:
    values: torch.Tensor  # integer-valued float [out, in], on the grid
    scales: torch.Tensor  # [out, groups]
    zeros: torch.Tensor  # [out, groups]
    g_idx: torch.Tensor  # int32 [in]

    def storage(self, grid: Grid) -> dict[str, torch.Tensor]:
        """tritonlm's quantized tensors: w = q * scale + bias."""
        if grid.symmetric:
            return {"qweight": self.values.to(torch.int8), "scales": self.scales, "g_idx": self.g_idx}
        return {"qweight": pack_int4(self.values), "scales": self.scales,
                "biases": -self.zeros * self.scales, "g_idx": self.g_idx}


def upper_inverse_cholesky(hessian: torch.Tensor) -> torch.Tensor:
    """U with U^T U = (H + damping)^-1, dampened more until H is positive definite."""
    identity = torch.eye(len(hessian))
    damp = DAMPING * hessian.diagonal().mean()
    for attempt in range(1, 11):
        lower, info = torch.linalg.cholesky_ex(hessian + attempt * damp * identity)
        if info == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
    raise ConversionError("a calibration Hessian stays singular after dampening; use more text")


def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, grid: Grid, group_size: int,
               act_order: bool = True) -> RoundedWeight:
    """GPTQ of one weight [out, in] against its Hessian [in, in]."""
    out_features, in_features = weight.shape
    weight, hessian = weight.clone().float(), hessian.clone()
    dead = hessian.diagonal() == 0  # inputs never active: any value does
    hessian[dead, dead] = 1
    weight[:, dead] = 0
    order = (torch.argsort(hessian.diagonal(), descending=True, stable=True) if act_order
             else torch.arange(in_features))
    weight, hessian = weight[:, order], hessian[order][:, order]
    inverse = upper_inverse_cholesky(hessian)
    size = group_size if group_size > 0 else in_features
    groups = -(-in_features // size)
    block = size * max(1, BLOCK_COLUMNS // size) if group_size > 0 else BLOCK_COLUMNS
    values = torch.empty_like(weight)
    scales, zeros = torch.empty(out_features, groups), torch.empty(out_features, groups)
    for start in range(0, in_features, block):
        end = min(start + block, in_features)
        errors = torch.empty(out_features, end - start)
        for i in range(start, end):
            if i % size == 0:  # blocks hold whole groups, so these columns are up to date
                scales[:, i // size], zeros[:, i // size] = grid.fit(weight[:, i:i + size])
            scale, zero = scales[:, i // size], zeros[:, i // size]
            values[:, i] = grid.round(weight[:, i], scale, zero)
            error = (weight[:, i] - grid.dequantize(values[:, i], scale, zero)) / inverse[i, i]
            weight[:, i:end] -= error.unsqueeze(1) * inverse[i, i:end].unsqueeze(0)
            errors[:, i - start] = error
        weight[:, end:] -= errors @ inverse[start:end, end:]
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = torch.arange(in_features, dtype=torch.int32) // size
    unordered = torch.empty_like(values)
    unordered[:, order] = values
    return RoundedWeight(unordered, scales, zeros, g_idx)


def gptq_quantize(hf_dir: Path, weight_names: list[str], bits: int, group_size: int,
                  calibration_text: str, act_order: bool = True, **calibration) -> dict[str, Storage]:
    """GPTQ-quantize the named linear weights (`<module>.weight`, Hugging Face names) of the model
    in hf_dir to `bits` (4: asymmetric, 8: symmetric); weight name -> its quantized tensors
    (qweight, scales, [biases,] g_idx)."""
    if bits not in (4, 8):
        raise ConversionError(f"GPTQ quantizes to 4 or 8 bits, not {bits}")
    grid = Grid(bits, symmetric=bits == 8)

    def quantize_layer(work: LayerWork) -> dict[str, Storage]:
        statistics = work.input_statistics(list(work.linears))
        return {name: gptq_round(linear.weight, statistics[name].hessian, grid, group_size, act_order).storage(grid)
                for name, linear in work.linears.items()}

    return quantize_layer_by_layer(hf_dir, weight_names, calibration_text, quantize_layer, "GPTQ", **calibration)
