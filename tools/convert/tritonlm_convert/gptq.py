"""GPTQ (Frantar et al. 2022): each linear weight is rounded column by column, and each column's
rounding error is spread over the columns not yet rounded through the inverse Hessian of the
layer's output error on calibration inputs, H = 2 X^T X / N. Columns go in decreasing H diagonal
order (act-order; `g_idx` keeps the groups so nothing is reordered at serving time), in blocks
whose updates to the later columns are applied once per block (lazy batch updates).

Layers are quantized one after another (as AutoGPTQ does): one float pass of transformers' model
records how it calls each layer, then each layer runs on the output of the layer before it,
already quantized, so its Hessians are measured on the inputs the quantized model will give it;
the other arguments (masks, rotary tables, position biases, a T5 decoder's encoder states) are
the float pass's. The linears of one layer share its pass.

Each group's range is searched (clipping its extremes by up to CLIP_STEPS percent, as GPTQ's
`mse` option does), and its zero point is not rounded: both cut the error of a 4-bit grid.

Output, per weight, is tritonlm's storage (layers/quantization.py): int4 asymmetric (values
0..15 with a float zero point, stored as biases), int8 symmetric (no biases); groups of
`group_size` input columns, or one per output row with -1.
"""
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer
from tritonlm.layers.quantization import dequantize, pack_int4
from tritonlm.models.registry import context_limit

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

    def fit(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row scale and zero for weight [out, columns]: of the ranges that clip the row's
        extremes (and 0) by 0 to CLIP_STEPS percent, the one with the least squared error."""
        low, high = self.levels
        if self.symmetric:
            top = weight.abs().amax(1)
            bottom = -top * (-low / high)
        else:
            bottom, top = weight.amin(1).clamp(max=0), weight.amax(1).clamp(min=0)
        best = None
        for shrink in 1 - torch.arange(CLIP_STEPS) / 100:
            scale = (top - bottom) * shrink / (high - low)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            zero = torch.zeros_like(scale) if self.symmetric else low - bottom * shrink / scale
            error = (self.dequantize(self.round(weight, scale[:, None], zero[:, None]),
                                     scale[:, None], zero[:, None]) - weight).square().sum(1)
            if best is None:
                best = error, scale, zero
            else:
                better = error < best[0]
                best = tuple(torch.where(better, new, old) for new, old in zip((error, scale, zero), best))
        return best[1], best[2]

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


def calibration_sequences(tokenizer, text: str, length: int, count: int) -> list[torch.Tensor]:
    """Up to `count` consecutive pieces of the text of `length` tokens (BOS first, if any)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ConversionError("the calibration text has no tokens")
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    step = length - len(bos)
    return [torch.tensor([bos + ids[i:i + step]]) for i in range(0, len(ids), step)][:count]


class _StopForward(Exception):
    """Raised after the last layer to quantize: the rest of the model is not needed."""


@dataclass
class LayerCall:
    """How the model called a layer for one calibration sequence, its hidden states set apart
    (`hidden`: kept only where the layer's input is not the previous layer's output)."""
    args: tuple
    kwargs: dict
    positional: bool  # whether the hidden states came first among args
    hidden: torch.Tensor | None

    def run(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if self.positional:
            output = layer(hidden, *self.args, **self.kwargs)
        else:
            output = layer(*self.args, hidden_states=hidden, **self.kwargs)
        return output[0] if isinstance(output, tuple) else output


def record_calls(model: nn.Module, layers: list[nn.Module], chain_starts: set[nn.Module],
                 sequences: list[torch.Tensor]) -> dict[nn.Module, list[LayerCall]]:
    """One float pass recording each layer's calls (up to the last layer)."""
    calls = {layer: [] for layer in layers}

    def recorder(layer):
        def record(module, args, kwargs):
            kwargs = dict(kwargs)
            positional = bool(args)
            hidden = args[0] if positional else kwargs.pop("hidden_states", None)
            if hidden is None:
                raise ConversionError(f"cannot find the hidden states {type(layer).__name__} is called with")
            calls[layer].append(LayerCall(args[1:], kwargs, positional,
                                          hidden if layer in chain_starts else None))
        return record

    def stop(module, args, output):
        raise _StopForward

    hooks = [layer.register_forward_pre_hook(recorder(layer), with_kwargs=True) for layer in layers]
    hooks.append(layers[-1].register_forward_hook(stop))
    try:
        for ids in sequences:
            extra = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
            try:
                model(input_ids=ids, use_cache=False, **extra)
            except _StopForward:
                pass
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def collect_hessians(layer: nn.Module, linears: dict[str, nn.Linear], calls: list[LayerCall],
                     inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """2 X^T X / N over the inputs X each linear of the layer sees while it runs the calibration."""
    sums = {name: torch.zeros(lin.in_features, lin.in_features) for name, lin in linears.items()}
    rows = dict.fromkeys(linears, 0)

    def accumulator(name):
        def accumulate(module, args):
            x = args[0].reshape(-1, module.in_features).float()
            sums[name].addmm_(x.T, x)
            rows[name] += len(x)
        return accumulate

    hooks = [lin.register_forward_pre_hook(accumulator(name)) for name, lin in linears.items()]
    try:
        for call, hidden in zip(calls, inputs):
            call.run(layer, hidden)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: 2 * sums[name] / max(rows[name], 1) for name in linears}


def _layer_of(module_name: str) -> str:
    """The numbered layer (`model.layers.3`) a module is in, or the module itself."""
    parts = module_name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
    return ".".join(parts[:index + 1])


def _follows(layer: str, previous: str) -> bool:
    """Whether `layer` is the next in `previous`'s layer list, so its input is previous's output."""
    parent, _, index = layer.rpartition(".")
    return index.isdigit() and previous == f"{parent}.{int(index) - 1}"


def gptq_quantize(hf_dir: Path, weight_names: list[str], bits: int, group_size: int,
                  calibration_text: str, act_order: bool = True, sequence_length: int = 512,
                  max_sequences: int = 128) -> dict[str, dict[str, torch.Tensor]]:
    """GPTQ-quantize the named linear weights (`<module>.weight`, Hugging Face names) of the model
    in hf_dir to `bits` (4: asymmetric, 8: symmetric); weight name -> its quantized tensors
    (qweight, scales, [biases,] g_idx)."""
    if bits not in (4, 8):
        raise ConversionError(f"GPTQ quantizes to 4 or 8 bits, not {bits}")
    config = AutoConfig.from_pretrained(hf_dir)
    auto_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = auto_class.from_pretrained(hf_dir, dtype=torch.float32).eval()
    length = min(sequence_length, context_limit(config))
    sequences = calibration_sequences(AutoTokenizer.from_pretrained(hf_dir), calibration_text,
                                      length, max_sequences)
    modules = dict(model.named_modules())
    stages: dict[str, dict[str, nn.Linear]] = {}  # layer path -> weight name -> its linear
    for name in weight_names:
        path = name.removesuffix(".weight")
        path = path if path in modules else f"{model.base_model_prefix}.{path}"
        if not isinstance(modules.get(path), nn.Linear):
            raise ConversionError(f"{name} is not the weight of a linear layer, so GPTQ cannot quantize it")
        stages.setdefault(_layer_of(path), {})[name] = modules[path]
    module_order = list(modules)
    order = sorted(stages, key=module_order.index)
    chained = {layer for layer, previous in zip(order[1:], order) if _follows(layer, previous)}
    grid = Grid(bits, symmetric=bits == 8)
    quantized, outputs = {}, []
    with torch.no_grad():
        calls = record_calls(model, [modules[s] for s in order],
                             {modules[s] for s in order if s not in chained}, sequences)
        for stage in order:
            layer = modules[stage]
            inputs = outputs if stage in chained else [call.hidden for call in calls[layer]]
            hessians = collect_hessians(layer, stages[stage], calls[layer], inputs)
            for name, linear in stages[stage].items():
                rounded = gptq_round(linear.weight, hessians[name], grid, group_size, act_order)
                storage = rounded.storage(grid)
                # the next layers get what the engine will compute
                linear.weight.copy_(dequantize(**{"biases": None, **storage}, dtype=torch.float32))
                quantized[name] = storage
            outputs = [call.run(layer, hidden) for call, hidden in zip(calls[layer], inputs)]
    return quantized
