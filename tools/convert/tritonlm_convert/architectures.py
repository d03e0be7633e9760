"""Which architectures convert, which tensors each needs, and how GGUF files name them.

The engine's model registry is the single list of supported architectures, and the engine's own
loading plan decides which checkpoint tensors a model needs; the converter checks a source against
that plan and writes exactly those tensors. GGUF files name tensors llama.cpp's way, mapped here.
"""
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tritonlm.distributed.parallel_state import as_rank
from tritonlm.models.loader import (Shard, build_model, checkpoint_plan, fused_g_idx,
                                    shard_plan, use_quantized_storage)
from tritonlm.models.registry import MODELS, supported_architectures
from transformers import PretrainedConfig

from .errors import ConversionError

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class GGUFLayout:
    """How a GGUF architecture's tensors map to a Hugging Face architecture's names."""

    architecture: str  # the Hugging Face `architectures` entry
    model_type: str  # config.json `model_type`
    tensors: dict[str, str]  # GGUF name -> HF name, without .weight
    layer_tensors: dict[str, str] = field(default_factory=dict)  # the same for blk.N.* tensors
    rope_permuted: bool = False  # llama.cpp permuted the q/k rows for its rope layout


GGUF_LAYOUTS = {
    "llama": GGUFLayout(
        architecture="LlamaForCausalLM",
        model_type="llama",
        tensors={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
        layer_tensors={
            "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
        },
        rope_permuted=True,
    ),
}


def lookup(config: dict) -> str:
    """The supported entry of a config.json's `architectures`; ConversionError if none is."""
    names = config.get("architectures") or []
    for name in names:
        if name in MODELS:
            return name
    raise ConversionError(f"unsupported architecture {names or '(none given)'}; "
                          f"supported: {', '.join(supported_architectures())}")


def lookup_gguf(gguf_arch: str) -> GGUFLayout:
    """The layout of GGUF files whose `general.architecture` is gguf_arch."""
    if gguf_arch not in GGUF_LAYOUTS:
        raise ConversionError(f"unsupported GGUF architecture {gguf_arch!r}; "
                              f"supported: {', '.join(sorted(GGUF_LAYOUTS))}")
    return GGUF_LAYOUTS[gguf_arch]


def select_tensors(config: PretrainedConfig, found: Shapes, load: Callable[[str], torch.Tensor],
                   tp: int = 1) -> list[dict[str, Shard]]:
    """Per tensor-parallel rank, the tensors the engine reads (in the source's order) and how
    that rank's slice is cut from each, after checking the source against the engine's plan."""
    try:
        model = build_model(config)
        use_quantized_storage(model, found)
        plan = checkpoint_plan(model, found)
        for parts in fused_g_idx(model, found):
            first = load(parts[0])
            if not all(torch.equal(first, load(part)) for part in parts[1:]):
                raise ValueError(f"fused layer parts {', '.join(parts)} quantize their shared "
                                 "input columns in different groups")
        ranks = []
        for rank in range(tp):
            with as_rank(rank, tp):
                model = build_model(config)
                use_quantized_storage(model, found)
                shards = shard_plan(model, plan, found)
            ranks.append({name: shards[name] for name in found if name in shards})
    except ValueError as e:
        raise ConversionError(str(e)) from None
    return ranks
