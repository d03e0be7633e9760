"""--keep-quantized: a GGUF file's Q8_0, Q4_0 and Q4_1 linear weights written as the engine's
quantized storage without dequantizing, equal value for value to gguf-py's dequantization, and
served like the dequantized conversion."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, GGUFReader, quants
from safetensors.torch import load_file
from transformers import AutoConfig

from test_convert import GGUF_LAYER_LAYOUT, _llama_cpp_permute, _save_tiny, _write_tiny_gguf
from test_quantize import dequantized_weights
from tritonlm import LLM, SamplingParams
from tritonlm.config import WEIGHTS_DIR
from tritonlm_convert.convert import convert, default_gguf_path
from tritonlm_convert.gguf_dequant import block_values

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 16


def rank_file(model_dir) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "1" / WEIGHTS_DIR / "rank0.safetensors")


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_block_values_restore_what_gguf_dequantizes(qtype):
    weight = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = quants.quantize(weight, qtype)
    values, scales, biases = block_values(raw, qtype, weight.shape)
    assert values.dtype == (np.int8 if qtype == T.Q8_0 else np.uint8) and values.shape == weight.shape
    assert values.max() <= (127 if qtype == T.Q8_0 else 15) and scales.shape == (6, 3)
    restored = values.astype(np.float32) * np.repeat(scales, 32, axis=1)
    if biases is not None:
        restored += np.repeat(biases, 32, axis=1)
    np.testing.assert_array_equal(restored, quants.dequantize(raw, qtype))


@pytest.fixture(scope="module")
def kept_smollm2(tmp_path_factory):
    return convert("default", tmp_path_factory.mktemp("kept"), dtype="float32", keep_quantized=True)


def test_kept_smollm2_weights_are_the_gguf_blocks(kept_smollm2):
    """SmolLM2's linear weights are all Q4_1; q/k rows come un-permuted (llama.cpp permutes them).
    Its head is the embedding (tied), Q8_0: kept so, once, for both."""
    ours = rank_file(kept_smollm2)
    weights = dequantized_weights(ours)
    tensors = {t.name: t for t in GGUFReader(default_gguf_path()).tensors}
    embedding = tensors["token_embd.weight"]
    assert embedding.tensor_type == T.Q8_0 and ours["model.embed_tokens.quantized.qweight"].dtype == torch.int8
    np.testing.assert_array_equal(weights.pop("model.embed_tokens.weight").numpy(),
                                  quants.dequantize(embedding.data, embedding.tensor_type))
    assert not any(name.startswith("lm_head") for name in ours) and "model.embed_tokens.weight" not in ours
    assert len(weights) == 30 * 7
    assert all(ours[f"{name[:-len('weight')]}quantized.qweight"].dtype == torch.uint8 for name in weights)
    assert 'string_value: "gguf-q4_1+q8_0"' in (kept_smollm2 / "config.pbtxt").read_text()
    gguf_names = {part: base for part, (base, _) in GGUF_LAYER_LAYOUT.items()}
    heads = {"attn_q": 9, "attn_k": 3}
    for name, weight in weights.items():
        layer, part = name.split(".")[2], name.split(".", 3)[3].removesuffix(".weight")
        gguf_name = gguf_names[part]
        tensor = tensors[f"blk.{layer}.{gguf_name}.weight"]
        assert tensor.tensor_type == T.Q4_1
        stored = weight.numpy()
        if gguf_name in heads:
            stored = _llama_cpp_permute(stored, heads[gguf_name])
        np.testing.assert_array_equal(stored, quants.dequantize(tensor.data, tensor.tensor_type), err_msg=name)


def test_kept_smollm2_generates_what_the_dequantized_conversion_does(kept_smollm2, smollm2_repo):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    kept = [out.token_ids for out in LLM(str(kept_smollm2), quantized_activations="float").generate(PROMPTS, params)]
    dequantized = [out.token_ids for out in LLM(str(smollm2_repo)).generate(PROMPTS, params)]
    assert kept == dequantized
    size = (kept_smollm2 / "1" / WEIGHTS_DIR / "rank0.safetensors").stat().st_size
    assert size < 1.2 * default_gguf_path().stat().st_size  # float32 scales and biases: 1.14


# q/k/v kept at 4 bits (Q4_0 and Q4_1 parts fuse), o_proj at 8; gate/up mix 4 and 8 bits, which
# one fused storage cannot hold, and Q5_0 is not kept: those are dequantized.
MIXED_LAYOUT = {**GGUF_LAYER_LAYOUT, "self_attn.q_proj": ("attn_q", "Q4_0"), "self_attn.k_proj": ("attn_k", "Q4_1"),
                "self_attn.v_proj": ("attn_v", "Q4_0"), "self_attn.o_proj": ("attn_output", "Q8_0"),
                "mlp.gate_proj": ("ffn_gate", "Q4_1"), "mlp.up_proj": ("ffn_up", "Q8_0"),
                "mlp.down_proj": ("ffn_down", "Q5_0")}


def test_mixed_gguf_keeps_the_layers_its_storage_can_hold(tmp_path):
    state = {name: tensor.float() for name, tensor in _save_tiny(tmp_path / "hf").items()}
    config = AutoConfig.from_pretrained(tmp_path / "hf")
    _write_tiny_gguf(tmp_path / "tiny.gguf", state, config, MIXED_LAYOUT)
    kept_dir = convert(str(tmp_path / "tiny.gguf"), tmp_path / "kept", dtype="float32",
                       keep_quantized=True)
    float_dir = convert(str(tmp_path / "tiny.gguf"), tmp_path / "float", dtype="float32")
    kept, dequantized = rank_file(kept_dir), rank_file(float_dir)
    weights = dequantized_weights(kept)
    assert sorted({name.split(".", 3)[3] if name.startswith("model.layers.") else name for name in weights}) == [
        "lm_head.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight", "self_attn.q_proj.weight",
        "self_attn.v_proj.weight"]  # the head is Q8_0 (untied)
    assert kept["model.layers.0.self_attn.o_proj.quantized.qweight"].dtype == torch.int8
    assert "model.layers.0.self_attn.o_proj.quantized.biases" not in kept
    assert 'string_value: "gguf-q4_0+q4_1+q8_0"' in (kept_dir / "config.pbtxt").read_text()
    for name, tensor in dequantized.items():
        assert torch.equal(weights.get(name, kept.get(name)), tensor), name
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [[256, 72, 101, 108, 108, 111], [256, 50, 43, 50]]
    kept = LLM(str(kept_dir), block_size=8, quantized_activations="float")
    assert [out.token_ids for out in kept.generate(prompts, params)] == \
        [out.token_ids for out in LLM(str(float_dir), block_size=8).generate(prompts, params)]
