"""Weight-only quantization at conversion time: which weights are quantizable, round-to-nearest
int8 / int4 (the engine's quantizers), the LM head in int8, and the source wrapper that writes each quantized weight as the
engine's storage (`X.quantized.*`, layers/quantization.py) in place of `X.weight`, one weight at
a time."""
from typing import Callable

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from tritonlm.layers.quantization import QUANTIZED, quantize_int4, quantize_int8
from tritonlm.models.loader import build_model, checkpoint_plan

from .architectures import Shapes
from .errors import ConversionError
from .sources import Source

DEFAULT_GROUP_SIZE = 32  # measured best on SmolLM2 for RTN, GPTQ and AWQ alike (README: Quantization)
Storage = dict[str, torch.Tensor]  # leaf (qweight, scales, biases, g_idx) -> tensor
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]  # leaf -> shape and dtype


def _source_plan(model, found: Shapes) -> dict[str, list[str]]:
    """loader.checkpoint_plan, its misfits as conversion errors."""
    try:
        return checkpoint_plan(model, found)
    except ValueError as e:
        raise ConversionError(str(e)) from None


def is_quantized(shapes: Shapes) -> bool:
    return any(f".{QUANTIZED}." in name for name in shapes)


def quantizable_layers(config: PretrainedConfig, found: Shapes) -> list[list[str]]:
    """Per layer that can hold quantized storage (the parallel linear layers: not embeddings, norms
    or the LM head), its checkpoint weights: one, or the parts of a fused layer, which must be
    quantized alike (same bits, groups and biases) as they are stacked into one storage."""
    model = build_model(config)
    plan = _source_plan(model, found)
    return [plan[f"{path}.weight"] for path, module in model.named_modules()
            if hasattr(module, "use_quantized_weight") and not isinstance(module, nn.Embedding)]


def embedding_name(config: PretrainedConfig, found: Shapes) -> str | None:
    """The token embedding's source tensor, when the engine can look its rows up in quantized
    storage (layers/embedding.py); None otherwise."""
    model = build_model(config)
    if not hasattr(model, "input_embeddings") or not hasattr(model.input_embeddings(), "use_quantized_weight"):
        return None
    plan = _source_plan(model, found)
    return plan[f"{model.decoder_name}.{model.embedding_name}.weight"][0]


def storage_layout(out_features: int, in_features: int, bits: int, num_groups: int,
                   has_biases: bool) -> Layout:
    packed_in = in_features // 2 if bits == 4 else in_features
    layout = {"qweight": ((out_features, packed_in), torch.uint8 if bits == 4 else torch.int8),
              "scales": ((out_features, num_groups), torch.float32)}
    if has_biases:
        layout["biases"] = ((out_features, num_groups), torch.float32)
    layout["g_idx"] = ((in_features,), torch.int32)
    return layout


def rtn_layout(shape: tuple[int, ...], bits: int, group_size: int) -> Layout:
    out_features, in_features = shape
    if bits == 8:
        return storage_layout(out_features, in_features, 8, 1, has_biases=False)
    if in_features % 2:
        raise ConversionError(f"int4 packs two columns a byte and needs an even input width, not {in_features}")
    return storage_layout(out_features, in_features, 4, -(-in_features // group_size), has_biases=True)


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int) -> Storage:
    return quantize_int8(weight) if bits == 8 else quantize_int4(weight, group_size)


def layout_of(storage: Storage) -> Layout:
    return {leaf: (tuple(t.shape), t.dtype) for leaf, t in storage.items() if t is not None}


class QuantizedSource(Source):
    """`inner` with each weight named in `layouts` (`X.weight`) replaced by its quantized storage
    `X.quantized.<leaf>`, which `quantize(source tensor name)` produces when the weight is
    written. `copies` names weights added as quantized copies of another tensor, which stays (a
    tied LM head: lm_head.weight -> the embedding); `replaced`, float tensors given new values
    (the norms AWQ folds its scales into)."""

    def __init__(self, inner: Source, layouts: dict[str, Layout], quantize: Callable[[str], Storage],
                 quantization: str, copies: dict[str, str] | None = None,
                 replaced: dict[str, torch.Tensor] | None = None):
        self.inner, self.quantize, self.quantization = inner, quantize, quantization
        self.raw_config, self.stored_dtype = inner.raw_config, inner.stored_dtype
        self.copies, self.replaced = copies or {}, replaced or {}
        self._shapes, self._dtypes, self._leaves = {}, {}, {}
        for name, shape in [*inner.tensor_shapes().items(), *((c, None) for c in self.copies)]:
            if name not in layouts:
                self._shapes[name] = shape
                continue
            base = name.removesuffix(".weight")
            for leaf, (leaf_shape, dtype) in layouts[name].items():
                stored = f"{base}.{QUANTIZED}.{leaf}"
                self._shapes[stored], self._dtypes[stored] = leaf_shape, dtype
                self._leaves[stored] = self.copies.get(name, name), leaf
        self._last: tuple[str, Storage] | None = None  # the leaves of a weight are written in a row

    def tensor_shapes(self) -> Shapes:
        return dict(self._shapes)

    def tensor_dtype(self, name: str) -> torch.dtype | None:
        return self._dtypes[name] if name in self._dtypes else self.inner.tensor_dtype(name)

    def load(self, name: str) -> torch.Tensor:
        if name in self.replaced:
            return self.replaced[name]
        if name not in self._leaves:
            return self.inner.load(name)
        weight, leaf = self._leaves[name]
        if self._last is None or self._last[0] != weight:
            self._last = weight, self.quantize(weight)
        return self._last[1][leaf]

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.inner.tokenizer()

    def generation_config(self) -> dict:
        return self.inner.generation_config()


def head_names(config: PretrainedConfig, found: Shapes) -> tuple[str, str] | None:
    """The LM head's weight as the converted checkpoint names it, and the source tensor holding
    it (the embedding, when tied); None for a model whose head the engine holds in float only."""
    model = build_model(config)
    if not hasattr(model, "use_quantized_head"):
        return None
    plan = _source_plan(model, found)
    return f"{model.head_name}.weight", plan[model.head_parameter()][0]


def with_int8_head(source: Source, names: tuple[str, str] | None) -> Source:
    """`source` with its LM head (`names`: see head_names) stored as int8 with a scale per output
    row (the float embedding stays for the input side when they are tied); as llama.cpp's 4-bit
    files keep their output tensor at more bits than the body. A decode step reads it whole."""
    if names is None:
        return source
    head, tensor = names
    layout = rtn_layout(source.tensor_shapes()[tensor], 8, 0)
    return QuantizedSource(source, {head: layout}, lambda name: quantize_int8(source.load(name)),
                           source.quantization, copies={head: tensor} if head != tensor else None)


def round_to_nearest(source: Source, weights: list[str], bits: int, group_size: int) -> QuantizedSource:
    shapes = source.tensor_shapes()
    layouts = {name: rtn_layout(shapes[name], bits, group_size) for name in weights}
    return QuantizedSource(source, layouts, lambda name: quantize_rtn(source.load(name), bits, group_size),
                           f"int{bits}")


def precomputed(source: Source, results: dict[str, Storage], quantization: str,
                replaced: dict[str, torch.Tensor] | None = None) -> QuantizedSource:
    """`source` with the weights GPTQ or AWQ quantized (weight name -> its storage) and the float
    tensors AWQ changed (`replaced`, by the source's names)."""
    results = {name: {leaf: t for leaf, t in storage.items() if t is not None}
               for name, storage in results.items()}
    layouts = {name: layout_of(storage) for name, storage in results.items()}
    return QuantizedSource(source, layouts, results.__getitem__, quantization, replaced=replaced)
