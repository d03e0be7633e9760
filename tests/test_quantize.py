"""Weight-only quantization by the converter: round-to-nearest int8 / int4 within half a step of
each weight, a quantized tiny Llama served exactly as transformers serves its dequantized weights
(one rank and two), the GPTQ hooks, and the options' errors."""
import json
import sys
import types

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from family_check import random_prompts, reference_greedy, save_tiny
from tritonlm import LLM, SamplingParams
from tritonlm.config import WEIGHTS_DIR, EngineConfig
from tritonlm.layers.quantization import (dequantize, pack_int4, quantize_int4, quantize_int8,
                                          unpack_int4)
from tritonlm_convert.cli import main
from tritonlm_convert.convert import convert, open_source
from tritonlm_convert.errors import ConversionError

NEW_TOKENS = 24
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rank_file(model_dir, rank: int = 0) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "1" / WEIGHTS_DIR / f"rank{rank}.safetensors")


# Fused layers' parts share their input columns: rank files hold the first part's g_idx only.
FIRST_PART = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def dequantized_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`X.weight` -> the weight the quantized storage `X.quantized.*` stands for."""
    weights = {}
    for base in {name.partition(".quantized.")[0] for name in tensors if ".quantized." in name}:
        parent, dot, part = base.rpartition(".")
        g_idx = tensors[f"{parent}{dot}{FIRST_PART.get(part, part)}.quantized.g_idx"]
        weights[f"{base}.weight"] = dequantize(tensors[f"{base}.quantized.qweight"],
                                               tensors[f"{base}.quantized.scales"],
                                               tensors.get(f"{base}.quantized.biases"), g_idx, torch.float32)
    return weights


def test_int4_packing_round_trips():
    values = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = pack_int4(values)
    assert packed.shape == (5, 6) and torch.equal(packed[:, 0] & 0xF, values[:, 0])
    assert torch.equal(unpack_int4(packed), values)


def _weight(rows: int, columns: int) -> torch.Tensor:
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(0))
    weight[1] = 0  # a zero row
    weight[2, :32] = 0.25  # a constant group
    return weight


def test_int8_is_symmetric_per_output_channel_within_half_a_step():
    weight = _weight(8, 96)
    storage = quantize_int8(weight)
    assert set(storage) == {"qweight", "scales", "g_idx"} and storage["qweight"].dtype == torch.int8
    # the scales in float16 precision, which the CPU kernel reads in 2 bytes
    step = (weight.abs().amax(dim=1, keepdim=True) / 127).half().float()
    assert torch.equal(storage["scales"], step) and torch.equal(storage["g_idx"], torch.zeros(96, dtype=torch.int32))
    assert storage["qweight"].abs().max() <= 127
    restored = storage["qweight"].float() * step
    assert ((weight - restored).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(restored[1], weight[1])


@pytest.mark.parametrize("size", [32, 64, 128], ids=["3-groups", "last-group-shorter", "one-group"])
def test_int4_is_asymmetric_per_group_within_half_a_step(size):
    weight = _weight(8, 96)
    storage = quantize_int4(weight, size)
    starts = range(0, 96, size)
    low = torch.stack([weight[:, start:start + size].amin(dim=1) for start in starts], dim=1)
    high = torch.stack([weight[:, start:start + size].amax(dim=1) for start in starts], dim=1)
    # both in float16 precision (as GGUF's Q4_1 stores them), which the CPU kernel reads in 2 bytes
    rounded_low = low.half().float()
    assert torch.equal(storage["biases"], rounded_low)
    assert torch.equal(storage["scales"], ((high - low) / 15).half().float())
    g_idx = torch.arange(96, dtype=torch.int32) // size
    assert torch.equal(storage["g_idx"], g_idx)
    assert storage["qweight"].dtype == torch.uint8 and storage["qweight"].shape == (8, 48)
    q = unpack_int4(storage["qweight"]).float()
    step = storage["scales"][:, g_idx]
    restored = q * step + rounded_low[:, g_idx]
    assert ((weight - restored).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(restored[1], weight[1])
    if size == 32:
        assert torch.equal(restored[2, :32], weight[2, :32])


def _tiny_llama(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.15)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_tokenizer):
    directory = tmp_path_factory.mktemp("tiny") / "hf"
    save_tiny(directory, LlamaForCausalLM, _tiny_llama(len(smollm2_tokenizer)), smollm2_tokenizer)
    return directory


# int4 groups of 48 columns: 2 groups (48 + 16) over the hidden width 64, 3 (48 + 48 + 32) over
# the intermediate width 128, which two ranks split inside the second group.
GROUPING = {"int8": {}, "int4": {"group_size": 48}}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_dir):
    """(method, tensor-parallel size) -> the tiny Llama converted with it (built once)."""
    done = {}

    def get(method: str, tp: int = 1):
        if (method, tp) not in done:
            done[method, tp] = convert(str(tiny_dir), tmp_path_factory.mktemp(f"{method}-tp{tp}"), dtype="float32",
                                       quantize=method, tp=tp, **GROUPING[method])
        return done[method, tp]
    return get


def _reference_with(tiny_dir, weights: dict[str, torch.Tensor]):
    """transformers' model of `tiny_dir` with its linear weights replaced."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    state = model.state_dict()
    assert set(weights) <= set(state)
    model.load_state_dict({**state, **weights})
    return model


@pytest.mark.parametrize("method", GROUPING)
def test_quantized_model_serves_what_transformers_does_with_its_dequantized_weights(
        tiny_dir, quantized, method):
    model_dir = quantized(method)
    tensors = rank_file(model_dir)
    weights = dequantized_weights(tensors)
    assert sorted(weights) == sorted(["lm_head.weight"] + [
        f"model.layers.{i}.{part}.{name}.weight" for i in (0, 1)
        for part, name in [*(("self_attn", n) for n in LINEAR[:4]), *(("mlp", n) for n in LINEAR[4:])]])
    groups = {"int8": (1, 1), "int4": (2, 3)}[method]
    assert tensors["model.layers.0.self_attn.q_proj.quantized.scales"].shape == (64, groups[0])
    assert tensors["model.layers.0.mlp.down_proj.quantized.scales"].shape == (64, groups[1])
    # the head in int8 with a scale per row, whatever the body's bits
    assert tensors["lm_head.quantized.qweight"].dtype == torch.int8
    assert tensors["lm_head.quantized.scales"].shape == (tensors["model.embed_tokens.weight"].shape[0], 1)
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32 and "lm_head.weight" not in tensors
    assert f'string_value: "{method}"' in (model_dir / "config.pbtxt").read_text()
    reference = _reference_with(tiny_dir, weights)
    prompts = random_prompts(3, reference.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outputs = LLM(str(model_dir), block_size=8, quantized_activations="float").generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == reference_greedy(reference, prompt, NEW_TOKENS)
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits, dim=-1)
        for step, entry in enumerate(out.logprobs):
            for top in entry["top_logprobs"]:
                assert abs(top["logprob"] - expected[step, top["token_id"]].item()) < 1e-4


def test_a_tied_head_is_quantized_beside_the_embedding(tmp_path, smollm2_tokenizer):
    """A tied model's int8 head is a copy: the input side keeps the float embedding; transformers
    runs it untied, with the dequantized head. --float-head keeps the head float (tied)."""
    config = _tiny_llama(len(smollm2_tokenizer))
    config.tie_word_embeddings = True
    save_tiny(tmp_path / "hf", LlamaForCausalLM, config, smollm2_tokenizer)
    model_dir = convert(str(tmp_path / "hf"), tmp_path / "int8", dtype="float32", quantize="int8")
    tensors = rank_file(model_dir)
    head = dequantized_weights(tensors)["lm_head.weight"]
    embedding = tensors["model.embed_tokens.weight"]
    assert tensors["lm_head.quantized.qweight"].dtype == torch.int8 and "lm_head.weight" not in tensors
    assert 0 < (head - embedding).abs().max() <= embedding.abs().amax(1).max() / 254 + 1e-6
    untied = tmp_path / "untied"
    config.tie_word_embeddings = False
    save_tiny(untied, LlamaForCausalLM, config, smollm2_tokenizer)
    reference = _reference_with(untied, {**{name: tensor for name, tensor in tensors.items()
                                            if ".quantized." not in name},
                                         **dequantized_weights(tensors)})
    prompts = random_prompts(2, config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = LLM(str(model_dir), block_size=8, quantized_activations="float").generate(prompts, params)
    assert [out.token_ids for out in outputs] == [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    float_head = rank_file(convert(str(tmp_path / "hf"), tmp_path / "float", dtype="float32",
                                   quantize="int8", float_head=True))
    assert not any(name.startswith("lm_head") for name in float_head)


@pytest.mark.parametrize("method", GROUPING)
def test_two_ranks_generate_what_one_rank_does(quantized, method):
    halves = rank_file(quantized(method, 2), 0), rank_file(quantized(method, 2), 1)
    down = "model.layers.0.mlp.down_proj.quantized."  # row-parallel: input columns split
    packed = 32 if method == "int4" else 64
    assert [half[down + "qweight"].shape for half in halves] == [(64, packed)] * 2
    columns = torch.arange(64, 128, dtype=torch.int32)
    assert torch.equal(halves[1][down + "g_idx"], columns // 48 if method == "int4" else columns * 0)
    prompts = random_prompts(3, 1000, max_len=24)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(quantized(method)), block_size=8, quantized_activations="float") as llm:
        expected = [out.token_ids for out in llm.generate(prompts, params)]
    with LLM(str(quantized(method, 2)), block_size=8, quantized_activations="float") as llm:
        assert [out.token_ids for out in llm.generate(prompts, params)] == expected


def test_command_line_options_reach_the_repository(tmp_path, tiny_dir):
    main([str(tiny_dir), "--output", str(tmp_path), "--dtype", "float32", "--quantize", "int4", "--group-size", "16",
          "--kv-cache-dtype", "int8", "--quantized-activations", "float"])
    engine = EngineConfig.load(tmp_path / "llm" / "1")
    assert engine.kv_cache_dtype == "int8" and engine.quantized_activations == "float"
    assert rank_file(tmp_path / "llm")["model.layers.0.mlp.down_proj.quantized.scales"].shape == (64, 8)
    assert 'string_value: "int4"' in (tmp_path / "llm" / "config.pbtxt").read_text()


def test_unknown_quantized_activations_are_refused(tmp_path, tiny_dir):
    with pytest.raises(ConversionError, match="quantized_activations must be one of"):
        convert(str(tiny_dir), tmp_path, quantized_activations="int4")
    assert not (tmp_path / "llm").exists()


def test_calibration_quantizes_with_gptq(tmp_path, tiny_dir, monkeypatch):
    calls = []

    def gptq_quantize(hf_dir, weight_names, bits, group_size, calibration_text):
        calls.append((hf_dir, bits, group_size, calibration_text))
        state = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
        return {name: quantize_int4(state[name] + 0.01, group_size) for name in weight_names}

    monkeypatch.setitem(sys.modules, "tritonlm_convert.gptq", types.SimpleNamespace(gptq_quantize=gptq_quantize))
    (tmp_path / "calibration.txt").write_text("some text")
    model_dir = convert(str(tiny_dir), tmp_path, dtype="float32", quantize="int4", group_size=64,
                        calibration=tmp_path / "calibration.txt")
    assert calls == [(tiny_dir, 4, 64, "some text")]
    state = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    weights = dequantized_weights(rank_file(model_dir))
    # the head is not calibrated: int8 rounded to nearest
    head = quantize_int8(state["lm_head.weight"])
    assert torch.equal(weights.pop("lm_head.weight"),
                       dequantize(head["qweight"], head["scales"], None, head["g_idx"], torch.float32))
    for name, weight in weights.items():
        assert torch.equal(weight, dequantize(*quantize_int4(state[name] + 0.01, 64).values(), torch.float32))
    assert 'string_value: "gptq-int4"' in (model_dir / "config.pbtxt").read_text()


def test_quantized_directories_open_by_their_method(tmp_path, tiny_dir, monkeypatch):
    class Source:
        def __init__(self, path, trust_pickle):
            self.path = path

    class GPTQSource(Source):
        pass

    class AWQSource(Source):
        pass

    monkeypatch.setitem(sys.modules, "tritonlm_convert.gptq_source", types.SimpleNamespace(GPTQSource=GPTQSource))
    monkeypatch.setitem(sys.modules, "tritonlm_convert.awq_source", types.SimpleNamespace(AWQSource=AWQSource))
    config = json.loads((tiny_dir / "config.json").read_text())
    for method in ("gptq", "awq", "bitsandbytes"):
        (tmp_path / method).mkdir()
        quantization = {"quant_method": method, "bits": 4}
        (tmp_path / method / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    assert type(open_source(str(tmp_path / "gptq"))) is GPTQSource
    assert type(open_source(str(tmp_path / "awq"))) is AWQSource
    with pytest.raises(ConversionError, match="quantized with bitsandbytes; only GPTQ and AWQ"):
        open_source(str(tmp_path / "bitsandbytes"))


def test_bad_quantization_options_are_one_line_errors(tmp_path, tiny_dir, quantized, capsys):
    (tmp_path / "text").write_text("calibration")
    int4 = quantized("int4")
    capsys.readouterr()  # the conversion's own progress, when this test is the first to ask for it
    cases = {
        "already quantized": ([str(int4 / "1" / WEIGHTS_DIR), "--quantize", "int8"], "already quantized"),
        "keep an HF directory": ([str(tiny_dir), "--keep-quantized"], "--keep-quantized applies to GGUF"),
        "quantize kept GGUF": (["default", "--keep-quantized", "--quantize", "int4"], "already quantized"),
        "calibrate GGUF": (["default", "--quantize", "int4", "--calibration", str(tmp_path / "text")],
                           "needs a Hugging Face model directory"),
        "calibration alone": ([str(tiny_dir), "--calibration", str(tmp_path / "text")], "need --quantize"),
        "int8 groups": ([str(tiny_dir), "--quantize", "int8", "--group-size", "32"], "applies to int4"),
        "no groups": ([str(tiny_dir), "--quantize", "int4", "--group-size", "0"], "must be positive"),
        "float head alone": ([str(tiny_dir), "--float-head"], "--float-head needs --quantize"),
    }
    for case, (args, message) in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--output", str(tmp_path / "repo")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 1, case
        assert err.startswith("tritonlm-convert: error: ") and err.count("\n") == 1, (case, err)
        assert message in err, (case, err)
    assert not (tmp_path / "repo").exists()
