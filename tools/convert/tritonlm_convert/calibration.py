"""Quantizing a model layer by layer on calibration text (GPTQ, AWQ), as AutoGPTQ and AutoAWQ
do: one float pass of transformers' model records how it calls each layer, then each layer runs
on the output of the layer before it, already quantized, so what is measured of its inputs is
what the quantized model will give it; the other arguments (masks, rotary tables, position biases,
a T5 decoder's encoder states) are the float pass's. The linears of one layer share its pass."""
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer
from tritonlm.layers.quantization import dequantize
from tritonlm.models.registry import context_limit

from .errors import ConversionError

Storage = dict[str, torch.Tensor]  # the engine's quantized tensors of one weight


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


def _layer_of(module_name: str) -> str:
    """The numbered layer (`model.layers.3`) a module is in, or the module itself."""
    parts = module_name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
    return ".".join(parts[:index + 1])


def _follows(layer: str, previous: str) -> bool:
    """Whether `layer` is the next in `previous`'s layer list, so its input is previous's output."""
    parent, _, index = layer.rpartition(".")
    return index.isdigit() and previous == f"{parent}.{int(index) - 1}"


@dataclass
class InputStatistics:
    """Of the inputs X [N, in] a linear sees: H = 2 X^T X / N (the Hessian of its squared output
    error) and the mean |x| of each input channel."""
    hessian: torch.Tensor
    mean_abs: torch.Tensor


@dataclass
class LayerWork:
    """One layer to quantize: its path in the model, the module, its linears to quantize (weight
    name -> module), and the calibration's calls of it with their hidden-state inputs."""
    path: str
    layer: nn.Module
    linears: dict[str, nn.Linear]
    calls: list[LayerCall]
    inputs: list[torch.Tensor]

    def input_statistics(self, names: list[str]) -> dict[str, InputStatistics]:
        """InputStatistics of the named linears' inputs over one run of the calibration (linears
        given the same input tensor, as q/k/v are, share theirs)."""
        sums, abs_sums, rows = {}, {}, {}
        shared: dict[str, str] = {}  # linear -> the one whose statistics it shares
        # id of an input tensor of the current call -> the first linear fed it (and the tensor,
        # held so that its id is not reused within the call)
        fed: dict[int, tuple[str, torch.Tensor]] = {}

        def accumulator(name):
            def accumulate(module, args):
                first = shared.setdefault(name, fed.setdefault(id(args[0]), (name, args[0]))[0])
                if first != name:
                    return
                x = args[0].reshape(-1, module.in_features).float()
                if name not in sums:
                    sums[name], abs_sums[name], rows[name] = torch.zeros(x.shape[1], x.shape[1]), 0, 0
                sums[name].addmm_(x.T, x)
                abs_sums[name] = abs_sums[name] + x.abs().sum(0)
                rows[name] += len(x)
            return accumulate

        hooks = [self.linears[name].register_forward_pre_hook(accumulator(name)) for name in names]
        try:
            for call, hidden in zip(self.calls, self.inputs):
                fed.clear()
                call.run(self.layer, hidden)
        finally:
            for hook in hooks:
                hook.remove()
        statistics = {name: InputStatistics(2 * sums[name] / rows[name], abs_sums[name] / rows[name])
                      for name in sums}
        missing = [name for name in names if name not in shared]
        if missing:
            raise ConversionError(f"the calibration never runs {', '.join(missing)}")
        return {name: statistics[shared[name]] for name in names}

    def outputs(self) -> list[torch.Tensor]:
        return [call.run(self.layer, hidden) for call, hidden in zip(self.calls, self.inputs)]


def quantize_layer_by_layer(hf_dir: Path, weight_names: list[str], calibration_text: str,
                            quantize_layer: Callable[[LayerWork], dict[str, Storage]], method: str,
                            sequence_length: int = 512, max_sequences: int = 128) -> dict[str, Storage]:
    """The named linear weights (`<module>.weight`, Hugging Face names) of the model in hf_dir
    quantized by `quantize_layer`, one layer after another; weight name -> its storage."""
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
            raise ConversionError(f"{name} is not the weight of a linear layer, so {method} cannot quantize it")
        stages.setdefault(_layer_of(path), {})[name] = modules[path]
    module_order = list(modules)
    order = sorted(stages, key=module_order.index)
    chained = {layer for layer, previous in zip(order[1:], order) if _follows(layer, previous)}
    quantized, outputs = {}, []
    with torch.no_grad():
        calls = record_calls(model, [modules[s] for s in order],
                             {modules[s] for s in order if s not in chained}, sequences)
        for stage in order:
            layer = modules[stage]
            inputs = outputs if stage in chained else [call.hidden for call in calls[layer]]
            work = LayerWork(stage, layer, stages[stage], calls[layer], inputs)
            for name, storage in quantize_layer(work).items():
                # the next layers get what the engine will compute
                work.linears[name].weight.copy_(dequantize(**{"biases": None, **storage}, dtype=torch.float32))
                quantized[name] = storage
            outputs = work.outputs()
    return quantized
