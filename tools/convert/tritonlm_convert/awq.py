"""AWQ (Lin et al. 2023, activation-aware weight quantization), as AutoAWQ and LMDeploy's
`lite auto_awq` do it, layer by layer on calibration text (calibration.py):

1. Scales. Where the linears sharing an input are fed by an op that can absorb a per-channel
   factor (a norm's weight, or the rows of a linear feeding them directly: v_proj -> o_proj,
   up_proj -> down_proj), input channel j is multiplied by s_j in the linears and divided by s_j
   in the op: exact in float, while the channels with large activations round relatively finer.
   s = x^a / w^(1-a) (x: the channel's mean |input|, w: its weights' mean size relative to their
   group's largest), normalized; a is searched on a grid for the least output error of the
   rounded linears, s = 1 (plain rounding) being a candidate too.
2. Clipping. Each group's range is searched for the least output error (q and k by the error of
   their weights, as AutoAWQ does: theirs reaches the output through the softmax).
3. Rounding to nearest on those ranges: int4 with a float zero point.

Output errors come from H = 2 X^T X / N: a weight error D costs trace(D H D^T) / 2 per token,
so no search step passes over the calibration tokens.
"""
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from .calibration import InputStatistics, LayerWork, Storage, quantize_layer_by_layer
from .errors import ConversionError
from .gptq import Grid, RoundedWeight

SCALE_GRID = 20  # exponents a tried: 0, 1/20, .. 19/20
GRID = Grid(4, symmetric=False)


@dataclass(frozen=True)
class Fold:
    """Linears sharing an input (module paths within a layer) and the op producing it."""
    previous: str
    linears: tuple[str, ...]


# Folds fed by a linear come first, so that a norm's fold is searched on that linear's final rows.
_LLAMA = (Fold("self_attn.v_proj", ("self_attn.o_proj",)), Fold("mlp.up_proj", ("mlp.down_proj",)),
          Fold("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          Fold("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))
_OPT = (Fold("self_attn.v_proj", ("self_attn.out_proj",)),
        Fold("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        Fold("final_layer_norm", ("fc1",)))
FOLDS = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "opt": _OPT}
WEIGHT_ERROR_ONLY = ("q_proj", "k_proj")


def grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in] -> [out, groups, group_size], the last group padded with zeros."""
    out_features, in_features = weight.shape
    groups = -(-in_features // group_size)
    padded = weight.new_zeros(out_features, groups * group_size)
    padded[:, :in_features] = weight
    return padded.view(out_features, groups, group_size)


def diagonal_blocks(hessian: torch.Tensor, group_size: int) -> torch.Tensor:
    """[in, in] -> its [groups, group_size, group_size] blocks along the diagonal (zero-padded)."""
    groups = -(-len(hessian) // group_size)
    padded = hessian.new_zeros(groups * group_size, groups * group_size)
    padded[:len(hessian), :len(hessian)] = hessian
    return padded.view(groups, group_size, groups, group_size).diagonal(dim1=0, dim2=2).permute(2, 0, 1)


def fit_groups(weight: torch.Tensor, group_size: int, hessian: torch.Tensor | None,
               clip: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] in groups, and each group's scale and zero: of the ranges with the least
    output error through `hessian`, or the least weight error (None)."""
    groups = grouped(weight, group_size)
    error = None
    if hessian is not None:
        blocks = diagonal_blocks(hessian, group_size)
        # d [out, groups, size] -> d_g H_g d_g^T per row and group, as one batched matmul
        error = lambda d: (torch.bmm(d.transpose(0, 1), blocks).transpose(0, 1) * d).sum(-1)  # noqa: E731
    return groups, *GRID.fit(groups, error, clip)


def rounded(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """weight rounded on its groups' full ranges and decoded."""
    groups, scale, zero = fit_groups(weight, group_size, None, clip=False)
    return GRID.fake_quantize(groups, scale, zero).flatten(1)[:, :weight.shape[1]]


def storage(weight: torch.Tensor, group_size: int, hessian: torch.Tensor | None) -> Storage:
    """The engine's int4 storage of weight on the ranges fit_groups finds."""
    groups, scale, zero = fit_groups(weight, group_size, hessian)
    values = GRID.round(groups, scale[..., None], zero[..., None]).flatten(1)[:, :weight.shape[1]]
    g_idx = torch.arange(weight.shape[1], dtype=torch.int32) // group_size
    return RoundedWeight(values, scale, zero, g_idx).storage(GRID)


def output_error(deviation: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    return ((deviation @ hessian) * deviation).sum()


def search_scales(weights: list[torch.Tensor], statistics: InputStatistics, group_size: int) -> torch.Tensor:
    """The input-channel scales of least output error for linears sharing an input."""
    stacked = torch.cat(weights)
    relative = grouped(stacked.abs(), group_size)
    relative = (relative / relative.amax(2, keepdim=True).clamp(min=1e-12)).flatten(1)
    weight_mean = relative[:, :stacked.shape[1]].mean(0)
    hessian = statistics.hessian

    def loss(scales):
        return sum(output_error(rounded(w * scales, group_size) / scales - w, hessian)
                   for w in weights)

    best_scales = torch.ones_like(weight_mean)
    best_loss = loss(best_scales)
    for exponent in torch.arange(SCALE_GRID) / SCALE_GRID:
        scales = (statistics.mean_abs.pow(exponent) / (weight_mean.pow(1 - exponent) + 1e-4)).clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        candidate = loss(scales)
        if candidate < best_loss:
            best_loss, best_scales = candidate, scales
    return best_scales


def fold_scales(previous: nn.Module, linears: list[nn.Linear], scales: torch.Tensor) -> None:
    """Input channel j of the linears times s_j, the previous op's output channel j over s_j."""
    if isinstance(previous, nn.Linear):
        previous.weight.div_(scales[:, None])
    else:
        previous.weight.div_(scales)
    if getattr(previous, "bias", None) is not None:
        previous.bias.div_(scales)
    for linear in linears:
        linear.weight.mul_(scales)


def _foldable(modules: dict[str, nn.Module], fold: Fold, quantized: set[nn.Module]) -> bool:
    previous = modules.get(fold.previous)
    linears = [modules.get(path) for path in fold.linears]
    if getattr(previous, "weight", None) is None or not all(linear in quantized for linear in linears):
        return False
    width = previous.out_features if isinstance(previous, nn.Linear) else previous.weight.shape[-1]
    return all(linear.in_features == width for linear in linears)


def awq_quantize(hf_dir: Path, weight_names: list[str], group_size: int, calibration_text: str,
                 **calibration) -> tuple[dict[str, Storage], dict[str, torch.Tensor]]:
    """AWQ int4 of the named linear weights of the model in hf_dir: weight name -> its storage,
    and the float tensors the scales were folded into (model tensor name -> new value)."""
    model_type = AutoConfig.from_pretrained(hf_dir).model_type
    if model_type not in FOLDS:
        raise ConversionError(f"AWQ folds its scales into the layers of {', '.join(FOLDS)} models, "
                              f"not {model_type}; use GPTQ (--quantize int4 --calibration FILE)")
    folded: dict[str, torch.Tensor] = {}

    def quantize_layer(work: LayerWork) -> dict[str, Storage]:
        modules = dict(work.layer.named_modules())
        name_of = {linear: name for name, linear in work.linears.items()}
        statistics = work.input_statistics(list(work.linears))
        for fold in FOLDS[model_type]:
            if not _foldable(modules, fold, set(name_of)):
                continue
            previous, linears = modules[fold.previous], [modules[path] for path in fold.linears]
            names = [name_of[linear] for linear in linears]
            scales = search_scales([linear.weight for linear in linears], statistics[names[0]], group_size)
            fold_scales(previous, linears, scales)
            scaled = statistics[names[0]]
            scaled = InputStatistics(scaled.hessian / torch.outer(scales, scales), scaled.mean_abs / scales)
            statistics.update(dict.fromkeys(names, scaled))
            changed = ("bias",) if previous in name_of else ("weight", "bias")  # quantized below
            for leaf in changed:
                if getattr(previous, leaf, None) is not None:
                    folded[f"{work.path}.{fold.previous}.{leaf}"] = getattr(previous, leaf).detach().clone()
        return {name: storage(linear.weight, group_size,
                              None if name.removesuffix(".weight").endswith(WEIGHT_ERROR_ONLY)
                              else statistics[name].hessian)
                for name, linear in work.linears.items()}

    quantized = quantize_layer_by_layer(hf_dir, weight_names, calibration_text, quantize_layer, "AWQ",
                                        **calibration)
    return quantized, folded
