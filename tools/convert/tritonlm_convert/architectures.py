"""Registry of supported model families: the tensors each expects and how its GGUF files are laid out.

Adding a family (Falcon, GPT-NeoX, BLOOM, OPT, MPT, GPT-BigCode, T5, ...) means adding one
`Architecture` entry to `REGISTRY`.
"""
import re
from dataclasses import dataclass, field
from typing import Callable

from .errors import ConversionError

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Architecture:
    """How one family's Hugging Face checkpoint is validated and, optionally, read from GGUF."""

    names: tuple[str, ...]  # the `architectures` entries of config.json
    model_type: str  # config.json `model_type`
    tensor_shapes: Callable[[dict], Shapes]  # expected HF tensor names and shapes for a config
    config_fields: tuple[str, ...]  # config keys the engine relies on, written out explicitly
    ignored_tensors: re.Pattern = re.compile(r"$^")  # checkpoint tensors that are not weights
    gguf_arch: str | None = None  # `general.architecture` of its GGUF files
    gguf_tensors: dict[str, str] = field(default_factory=dict)  # GGUF name -> HF name, without .weight
    gguf_layer_tensors: dict[str, str] = field(default_factory=dict)  # the same for blk.N.* tensors
    gguf_rope_permuted: bool = False  # llama.cpp permuted the q/k rows for its rope layout


def _llama_shapes(c: dict) -> Shapes:
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q_dim = c["num_attention_heads"] * c["head_dim"]
    kv_dim = c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    projections = {
        "self_attn.q_proj": (q_dim, hidden), "self_attn.k_proj": (kv_dim, hidden),
        "self_attn.v_proj": (kv_dim, hidden), "self_attn.o_proj": (hidden, q_dim),
        "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter),
    }
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        for proj, shape in projections.items():
            shapes[layer + proj + ".weight"] = shape
            if c.get("attention_bias" if proj.startswith("self_attn") else "mlp_bias"):
                shapes[layer + proj + ".bias"] = shape[:1]
        shapes[layer + "input_layernorm.weight"] = (hidden,)
        shapes[layer + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


_LLAMA_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "vocab_size",
    "hidden_act", "attention_bias", "mlp_bias", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id",
)

LLAMA = Architecture(
    names=("LlamaForCausalLM",),
    model_type="llama",
    tensor_shapes=_llama_shapes,
    config_fields=_LLAMA_FIELDS,
    ignored_tensors=re.compile(r".*\.rotary_emb\.inv_freq"),
    gguf_arch="llama",
    gguf_tensors={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
    gguf_layer_tensors={
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    },
    gguf_rope_permuted=True,
)

# Mistral checkpoints use the Llama tensor layout (without biases); the config adds sliding_window.
MISTRAL = Architecture(
    names=("MistralForCausalLM",),
    model_type="mistral",
    tensor_shapes=_llama_shapes,
    config_fields=(*(f for f in _LLAMA_FIELDS if not f.endswith("_bias")), "sliding_window"),
    ignored_tensors=LLAMA.ignored_tensors,
)

REGISTRY: tuple[Architecture, ...] = (LLAMA, MISTRAL)


def supported_names() -> list[str]:
    """All architecture names the converter accepts."""
    return [name for arch in REGISTRY for name in arch.names]


def lookup(config: dict) -> Architecture:
    """The registry entry for a config.json's `architectures`; ConversionError if unsupported."""
    names = config.get("architectures") or []
    for arch in REGISTRY:
        if any(name in arch.names for name in names):
            return arch
    raise ConversionError(f"unsupported architecture {names or '(none given)'}; "
                          f"supported: {', '.join(supported_names())}")


def lookup_gguf(gguf_arch: str) -> Architecture:
    """The registry entry that reads GGUF files of `general.architecture` gguf_arch."""
    for arch in REGISTRY:
        if arch.gguf_arch == gguf_arch:
            return arch
    readable = sorted(a.gguf_arch for a in REGISTRY if a.gguf_arch)
    raise ConversionError(f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(readable)}")


def select_tensors(arch: Architecture, config: dict, found: Shapes) -> Shapes:
    """The tensors to write, in the source's order, after checking them against the expected layout."""
    expected = arch.tensor_shapes(config)
    if config["tie_word_embeddings"]:
        found = {k: v for k, v in found.items() if k != "lm_head.weight"}  # a saved copy of the tie
    found = {k: v for k, v in found.items() if not arch.ignored_tensors.fullmatch(k)}
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    wrong = [f"{k} {found[k]} (expected {expected[k]})" for k in found if k in expected and found[k] != expected[k]]
    for problem, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise ConversionError(f"{problem} tensors: {', '.join(names[:3])}{more}")
    return found
