"""GGUF reading: dequantizers against gguf-py's reference, the q/k un-permutation, tokenizer rebuilding."""
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, GGMLQuantizationType, quants
from transformers import AutoTokenizer

from tritonlm_convert.convert import default_gguf_path
from tritonlm_convert.errors import ConversionError
from tritonlm_convert.gguf_dequant import SUPPORTED_TYPES, dequantize
from tritonlm_convert.gguf_source import GGUFSource, unpermute_rope
from tritonlm_convert.gguf_tokenizer import build_tokenizer
from tritonlm_convert.repository import save_tokenizer

SPM_FIXTURE = Path(__file__).parent / "data" / "convert_spm_vocab.json"


@pytest.fixture(scope="module")
def reader():
    return GGUFReader(default_gguf_path())


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_random_blocks_matches_gguf(qtype):
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 6, 8
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (rows, blocks_per_row * block_bytes), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # random bytes include inf/nan scales
        expected = quants.dequantize(raw, qtype)
        ours = dequantize(raw, qtype, expected.shape)
    assert ours.dtype == np.float32 and expected.shape == (rows, blocks_per_row * block_size)
    np.testing.assert_array_equal(ours, expected)  # nan positions must match too


def test_dequantize_real_tensors_match_gguf(reader):
    tensors = {t.name: t for t in reader.tensors}
    names = ["token_embd.weight", "blk.0.attn_norm.weight", "output_norm.weight",
             *(f"blk.{i}.{part}.weight" for i, part in [(0, "attn_q"), (3, "attn_k"), (7, "ffn_down"),
                                                         (15, "ffn_gate"), (29, "attn_output")])]
    kinds = {tensors[n].tensor_type for n in names}
    assert kinds == {GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.F32}
    for name in names:
        t = tensors[name]
        expected = quants.dequantize(t.data, t.tensor_type)
        ours = dequantize(t.data, t.tensor_type, tuple(int(d) for d in reversed(t.shape)))
        np.testing.assert_array_equal(ours, expected.reshape(ours.shape), err_msg=name)


def test_unsupported_quant_type_is_an_error():
    with pytest.raises(ConversionError, match="unsupported GGUF tensor type IQ2_XXS.*supported: F32, F16, BF16, Q8_0"):
        dequantize(np.zeros(66, np.uint8), GGMLQuantizationType.IQ2_XXS, (256,))


def test_dequantize_rejects_wrong_size():
    with pytest.raises(ConversionError, match="bytes"):
        dequantize(np.zeros(33, np.uint8), GGMLQuantizationType.Q8_0, (32,))


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_rope_inverts_llama_cpp_permutation(n_head):
    weight = np.random.default_rng(n_head).standard_normal((n_head * 64, 40)).astype(np.float32)
    # convert_hf_to_gguf.py, LlamaModel.permute
    permuted = weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, 40).swapaxes(1, 2).reshape(weight.shape)
    np.testing.assert_array_equal(unpermute_rope(permuted, n_head), weight)


@pytest.fixture(scope="module")
def meta():
    return GGUFSource(default_gguf_path()).meta


def _pre_tokens(meta, pre, text):
    tokenizer = build_tokenizer({**meta, "tokenizer.ggml.pre": pre}, 8192)
    return [piece for piece, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def test_pre_tokenizers(meta):
    assert _pre_tokens(meta, "smollm", "ab 123") == ["ab", "Ġ", "1", "2", "3"]
    assert _pre_tokens(meta, "gpt2", "ab 123") == ["ab", "Ġ123"]
    # Llama 3 groups digits by three and keeps a lone space before digits apart.
    assert _pre_tokens(meta, "llama3", "I'm 12345 ok\n\n") == ["I", "'m", "Ġ", "123", "45", "Ġok", "ĊĊ"]


def test_unknown_pre_tokenizer_is_an_error(meta):
    with pytest.raises(ConversionError, match="unsupported GGUF pre-tokenizer 'qwen2'.*smollm"):
        build_tokenizer({**meta, "tokenizer.ggml.pre": "qwen2"}, 8192)
    with pytest.raises(ConversionError, match="unsupported GGUF pre-tokenizer 'default'"):
        build_tokenizer({k: v for k, v in meta.items() if k != "tokenizer.ggml.pre"}, 8192)


def test_unsupported_tokenizer_model_is_an_error(meta):
    with pytest.raises(ConversionError, match="tokenizer model 'bert'"):
        build_tokenizer({**meta, "tokenizer.ggml.model": "bert"}, 8192)


def test_sentencepiece_vocab_encodes_like_sentencepiece(tmp_path):
    fixture = json.loads(SPM_FIXTURE.read_text())
    meta = {f"tokenizer.ggml.{key}": fixture[key] for key in (
        "tokens", "scores", "token_type", "bos_token_id", "eos_token_id", "unknown_token_id")}
    meta["tokenizer.ggml.model"] = "llama"  # no add_bos_token key: llama.cpp's default for it is true
    save_tokenizer(build_tokenizer(meta, 4096), tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    for text, ids in fixture["encodings"].items():
        assert tokenizer.encode(text) == [fixture["bos_token_id"], *ids], text
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text
