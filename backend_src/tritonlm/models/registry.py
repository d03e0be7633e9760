"""Maps a config's `architectures` entry to the model class that serves it."""
import importlib

from torch import nn

# Architecture name -> "module:Class" under tritonlm.models, imported on first use.
MODELS: dict[str, str] = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "qwen2:Qwen2ForCausalLM",
    "GemmaForCausalLM": "gemma:GemmaForCausalLM",
    "GPTNeoXForCausalLM": "gpt_neox:GPTNeoXForCausalLM",
    "FalconForCausalLM": "falcon:FalconForCausalLM",
    "OPTForCausalLM": "opt:OPTForCausalLM",
    "BloomForCausalLM": "bloom:BloomForCausalLM",
    "MptForCausalLM": "mpt:MptForCausalLM",
    "GPTBigCodeForCausalLM": "gpt_bigcode:GPTBigCodeForCausalLM",
    "T5ForConditionalGeneration": "t5:T5ForConditionalGeneration",
}

# Config fields that bound the positions a model was trained for, by family.
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
# ALiBi and relative-bucket models have no table to run out of; this is their default window.
UNBOUNDED_CONTEXT_DEFAULT = 2048


def supported_architectures() -> list[str]:
    return sorted(MODELS)


def model_class(config) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODELS:
            module, name = MODELS[arch].split(":")
            return getattr(importlib.import_module(f"tritonlm.models.{module}"), name)
    raise ValueError(f"unsupported architecture {architectures}; "
                     f"supported: {', '.join(supported_architectures())}")


def _rope_parameters(config) -> dict:
    return getattr(config, "rope_parameters", None) or {}


def context_limit(config) -> int:
    """The longest context the model's position scheme serves: what it was trained for, times
    the factor of dynamic NTK scaling, which exists to go past it."""
    for name in _CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            rope = _rope_parameters(config)
            return int(value * rope["factor"]) if rope.get("rope_type") == "dynamic" else value
    return UNBOUNDED_CONTEXT_DEFAULT


def kv_depends_only_on_prefix(config) -> bool:
    """Whether a block's K/V is fixed by the tokens before it, so prefix caching is exact: not
    with an encoder's output behind it, nor with dynamic NTK, whose frequencies follow the
    sequence's current length."""
    return (not getattr(config, "is_encoder_decoder", False)
            and _rope_parameters(config).get("rope_type") != "dynamic")
