"""Reading a GGUF file: Hugging Face config and tensor names from its metadata, dequantized weights
or, for the block types the engine's quantized storage holds, the quantized values as they are."""
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T, GGUFReader, Keys
from transformers import PreTrainedTokenizerFast
from tritonlm.layers.quantization import pack_int4

from .architectures import Shapes, lookup_gguf
from .errors import ConversionError
from .gguf_dequant import KEPT_GROUP_SIZE, KEPT_TYPES, block_values, check_supported, dequantize
from .gguf_tokenizer import build_tokenizer
from .quantize import QuantizedSource, Storage, storage_layout
from .sources import Source

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)")
# gguf-py's Keys.General sampling keys (in gguf releases that define them) -> generation_config.json
_SAMPLING_KEYS = {"SAMPLING_TEMP": "temperature", "SAMPLING_TOP_K": "top_k",
                  "SAMPLING_TOP_P": "top_p", "SAMPLING_MIN_P": "min_p",
                  "SAMPLING_PENALTY_REPEAT": "repetition_penalty"}


def _float32_value(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def unpermute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's q/k row order, `w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)`."""
    half_head = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half_head, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class GGUFSource(Source):
    """A GGUF file of a supported architecture."""

    stored_dtype = None

    def __init__(self, path: Path):
        try:
            self.reader = GGUFReader(path)
            self.meta = {name: field.contents() for name, field in self.reader.fields.items()}
        except Exception as e:  # the reader fails in many ways on a malformed file
            raise ConversionError(f"{path} is not a readable GGUF file: {e}") from None
        if Keys.General.ARCHITECTURE not in self.meta:
            raise ConversionError(f"{path} has no {Keys.General.ARCHITECTURE} metadata")
        self.layout = lookup_gguf(self.meta[Keys.General.ARCHITECTURE])
        self._tensors = {self._hf_name(t.name): t for t in self.reader.tensors}
        self._shapes = {name: tuple(int(d) for d in reversed(t.shape)) for name, t in self._tensors.items()}
        for tensor in self.reader.tensors:
            check_supported(tensor.tensor_type, tensor.name)
        try:
            self.raw_config = self._config()
        except KeyError as e:
            raise ConversionError(f"{path} lacks the GGUF metadata {e}") from None

    def _hf_name(self, gguf_name: str) -> str:
        base, _, kind = gguf_name.rpartition(".")
        layer = _LAYER_TENSOR.fullmatch(base)
        if layer:
            name = self.layout.layer_tensors.get(layer[2])
            name = name and f"model.layers.{layer[1]}.{name}"
        else:
            name = self.layout.tensors.get(base)
        if name is None:
            raise ConversionError(f"unsupported GGUF tensor {gguf_name} for architecture {self.layout.architecture}")
        return f"{name}.{kind}"

    def _config(self) -> dict:
        prefix = self.meta[Keys.General.ARCHITECTURE] + "."
        arch_meta = {k[len(prefix):]: v for k, v in self.meta.items() if k.startswith(prefix)}
        heads = arch_meta["attention.head_count"]
        head_dim = arch_meta.get("attention.key_length", arch_meta["embedding_length"] // heads)
        if arch_meta.get("rope.dimension_count", head_dim) != head_dim:
            raise ConversionError("GGUF models with partial rotary embeddings are not supported")
        config = {
            "architectures": [self.layout.architecture],
            "model_type": self.layout.model_type,
            "hidden_size": arch_meta["embedding_length"],
            "intermediate_size": arch_meta["feed_forward_length"],
            "num_hidden_layers": arch_meta["block_count"],
            "num_attention_heads": heads,
            "num_key_value_heads": arch_meta.get("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "max_position_embeddings": arch_meta["context_length"],
            "vocab_size": arch_meta.get("vocab_size", len(self.meta[Keys.Tokenizer.LIST])),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
            "mlp_bias": "model.layers.0.mlp.up_proj.bias" in self._tensors,
        }
        if "attention.layer_norm_rms_epsilon" in arch_meta:
            config["rms_norm_eps"] = _float32_value(arch_meta["attention.layer_norm_rms_epsilon"])
        if "rope.freq_base" in arch_meta:
            config["rope_theta"] = _float32_value(arch_meta["rope.freq_base"])
        scaling = arch_meta.get("rope.scaling.type", "none")
        if scaling != "none":
            config["rope_scaling"] = {"rope_type": scaling, "factor": _float32_value(arch_meta["rope.scaling.factor"])}
            if "rope.scaling.original_context_length" in arch_meta:
                config["rope_scaling"]["original_max_position_embeddings"] = \
                    arch_meta["rope.scaling.original_context_length"]
        for name, key in (("bos_token_id", Keys.Tokenizer.BOS_ID), ("eos_token_id", Keys.Tokenizer.EOS_ID),
                          ("pad_token_id", Keys.Tokenizer.PAD_ID)):
            config[name] = self.meta.get(key)
        return config

    def tensor_shapes(self) -> Shapes:
        """Every tensor, renamed to Hugging Face names, in file order."""
        return dict(self._shapes)

    def load(self, name: str) -> torch.Tensor:
        """One tensor, dequantized to float32, with llama.cpp's q/k row permutation undone."""
        tensor = self._tensors[name]
        return torch.from_numpy(self._unpermuted(name, dequantize(tensor.data, tensor.tensor_type,
                                                                  self._shapes[name])))

    def _unpermuted(self, name: str, rows: np.ndarray) -> np.ndarray:
        if self.layout.rope_permuted and ".self_attn.q_proj." in name:
            return unpermute_rope(rows, self.raw_config["num_attention_heads"])
        if self.layout.rope_permuted and ".self_attn.k_proj." in name:
            return unpermute_rope(rows, self.raw_config["num_key_value_heads"])
        return rows

    def keeping_quantized(self, layers: list[list[str]], head: tuple[str, str] | None,
                          embedding: str | None) -> Source:
        """This file with the linear layers stored in Q8_0, Q4_0 or Q4_1 kept quantized (8 or 4 bits,
        groups of 32) instead of dequantized, the token embedding (`embedding`, when given) and the
        LM head (`head`: its converted name and the tensor holding it, the embedding when tied and
        not kept itself) in such a type too. Other types, and fused layers whose parts are not all
        8-bit or all 4-bit, are dequantized."""
        kept = {}
        for layer in layers:
            types = [self._tensors[name].tensor_type for name in layer]
            if all(t in KEPT_TYPES for t in types) and len({t == T.Q8_0 for t in types}) == 1:
                kept.update(zip(layer, types))
        copies = {}
        if embedding is not None and self._tensors[embedding].tensor_type in KEPT_TYPES:
            kept[embedding] = self._tensors[embedding].tensor_type
        if head is not None and head[1] not in kept and self._tensors[head[1]].tensor_type in KEPT_TYPES:
            kept[head[0]] = self._tensors[head[1]].tensor_type
            if head[0] != head[1]:
                copies[head[0]] = head[1]
        if not kept:
            return self
        layouts = {}
        for name, qtype in kept.items():
            rows, cols = self._shapes[copies.get(name, name)]
            layouts[name] = storage_layout(rows, cols, 8 if qtype == T.Q8_0 else 4,
                                           cols // KEPT_GROUP_SIZE, has_biases=qtype != T.Q8_0)
        method = "+".join(sorted({T(qtype).name.lower() for qtype in kept.values()}))
        return QuantizedSource(self, layouts, self._load_kept, f"gguf-{method}", copies)

    def _load_kept(self, name: str) -> Storage:
        tensor = self._tensors[name]
        values, scales, biases = block_values(tensor.data, tensor.tensor_type, self._shapes[name])
        # Rows are permuted whole, so a row's values, scales and biases move together.
        storage = {leaf: torch.from_numpy(self._unpermuted(name, array)) for leaf, array in
                   (("qweight", values), ("scales", scales), ("biases", biases)) if array is not None}
        if tensor.tensor_type != T.Q8_0:
            storage["qweight"] = pack_int4(storage["qweight"])
        columns = self._shapes[name][1]
        storage["g_idx"] = torch.arange(columns, dtype=torch.int32) // KEPT_GROUP_SIZE
        return storage

    def tokenizer(self) -> PreTrainedTokenizerFast:
        """The tokenizer rebuilt from the `tokenizer.*` metadata."""
        return build_tokenizer(self.meta, self.raw_config["max_position_embeddings"])

    def generation_config(self) -> dict:
        """Special token ids, with end-of-turn tokens added to the ones generation stops on, and
        the recommended sampling settings the file names (`general.sampling.*`)."""
        config = super().generation_config()
        end_of_turn = [self.meta.get(k) for k in (Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)]
        stops = [config.get("eos_token_id"), *end_of_turn]
        stops = list(dict.fromkeys(s for s in stops if s is not None))
        if len(stops) > 1:
            config["eos_token_id"] = stops
        for key, name in _SAMPLING_KEYS.items():
            value = self.meta.get(getattr(Keys.General, key, None))
            if value is not None:
                config[name] = int(value) if name == "top_k" else _float32_value(value)
        return config
