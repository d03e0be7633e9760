"""Maps a config's `architectures` entry to the model class that serves it."""
from torch import nn

from tritonlm.models.llama import LlamaForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def model_class(config) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODELS:
            return MODELS[arch]
    raise ValueError(f"unsupported architecture {architectures}; supported: {sorted(MODELS)}")
