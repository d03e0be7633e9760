"""GPTQ: checkpoints in AutoGPTQ / GPTQModel layout serve exactly as their own dequantization,
and our GPTQ quantizer reconstructs calibration outputs better than round-to-nearest."""
import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tritonlm import LLM, SamplingParams
from tritonlm.layers.quantization import dequantize
from tritonlm_convert.convert import convert, open_source
from tritonlm_convert.errors import ConversionError
from tritonlm_convert.calibration import calibration_sequences
from tritonlm_convert.gptq import Grid, gptq_quantize, gptq_round
from tritonlm_convert.gptq_source import GPTQSource

from family_check import random_prompts

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_TOKENS = 24


def tiny_llama(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, initializer_range=0.15,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def pack_words(values: np.ndarray, bits: int) -> np.ndarray:
    """uint [rows, n] -> int32 [rows, n * bits / 32], value j of a word at bits * j."""
    per_word = 32 // bits
    words = np.zeros((values.shape[0], values.shape[1] // per_word), dtype=np.uint32)
    for j in range(per_word):
        words |= values[:, j::per_word].astype(np.uint32) << np.uint32(bits * j)
    return words.view(np.int32)


def autogptq_linear(weight: torch.Tensor, bits: int, group_size: int, order: torch.Tensor,
                    checkpoint_format: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Round-to-nearest in groups of `order`'s columns, in AutoGPTQ's tensors, and the weight
    those tensors decode to (w[:, i] = scale[g_idx[i]] * (q[i] - zero[g_idx[i]]))."""
    out_features, in_features = weight.shape
    maxq, size = 2 ** bits - 1, group_size if group_size > 0 else in_features
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = torch.arange(in_features, dtype=torch.int32) // size
    groups = in_features // size
    scales = torch.empty(groups, out_features, dtype=torch.float16)
    zeros = torch.empty(groups, out_features, dtype=torch.int64)
    for g in range(groups):
        w = weight[:, g_idx == g]
        low, high = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
        scales[g] = ((high - low) / maxq).half()
        zeros[g] = torch.round(-low / scales[g].float()).clamp(0, maxq)
    column_scales, column_zeros = scales.float()[g_idx.long()].T, zeros[g_idx.long()].T
    q = (torch.round(weight / column_scales) + column_zeros).clamp(0, maxq).long()
    stored_zeros = (zeros - 1) & maxq if checkpoint_format == "gptq" else zeros
    tensors = {
        "qweight": torch.from_numpy(pack_words(q.numpy(), bits).T.copy()),
        "qzeros": torch.from_numpy(pack_words(stored_zeros.numpy(), bits)),
        "scales": scales,
        "g_idx": g_idx,
    }
    # the decoding, from the stored zeros: v1 adds 1 (mod 2^bits, a zero of 0 was stored as -1)
    decoded_zeros = ((stored_zeros + 1) & maxq) if checkpoint_format == "gptq" else stored_zeros
    return tensors, (q - decoded_zeros[g_idx.long()].T).float() * column_scales


def write_gptq_checkpoint(directory: Path, model, tokenizer, bits: int, group_size: int,
                          desc_act: bool, checkpoint_format: str, quantize_head: bool = False,
                          settings_file: str = "config.json"):
    """The model quantized in AutoGPTQ's layout, saved; returns the model with each quantized
    weight replaced by its dequantization (the reference)."""
    generator = torch.Generator().manual_seed(1)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    tensors, orders = {}, {}
    for name, weight in state.items():
        module = name.removesuffix(".weight")
        if not (module.endswith(LINEARS) or (quantize_head and module == "lm_head")):
            tensors[name] = weight.half()
            state[name] = tensors[name].float()
            continue
        weight = weight.clone()
        weight[0] = weight[0].abs()  # a row whose zero point is 0 (v1 stores it as -1)
        # act-order sorts columns by the Hessian of the linear's inputs, shared by q/k/v and gate/up
        shared_input = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj") \
            .replace("up_proj", "gate_proj")
        order = orders.setdefault(shared_input, torch.randperm(weight.shape[1], generator=generator)
                                  if desc_act else torch.arange(weight.shape[1]))
        quantized, state[name] = autogptq_linear(weight, bits, group_size, order, checkpoint_format)
        tensors.update({f"{module}.{leaf}": t for leaf, t in quantized.items()})
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors")
    settings = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
                "sym": False, "checkpoint_format": checkpoint_format, "lm_head": quantize_head}
    config = {**model.config.to_dict(), "architectures": ["LlamaForCausalLM"], "torch_dtype": "float16"}
    if settings_file == "config.json":
        config["quantization_config"] = settings
    else:  # AutoGPTQ before transformers integration: a separate file, no quant_method
        (directory / settings_file).write_text(json.dumps({k: v for k, v in settings.items()
                                                           if k != "quant_method"}))
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(directory)
    model.load_state_dict(state)
    return model


def assert_serves_reference(llm: LLM, reference, vocab_size: int) -> None:
    """Greedy tokens and their logprobs equal transformers' on the dequantized weights."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    for prompt in random_prompts(2, vocab_size, max_len=20):
        out, = llm.generate([prompt], params)
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + out.token_ids])).logits[0]
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
        assert out.token_ids == expected.argmax(-1).tolist()
        got = torch.tensor([entry["logprob"] for entry in out.logprobs])
        torch.testing.assert_close(got, expected.gather(1, torch.tensor([out.token_ids]).T)[:, 0],
                                   atol=1e-4, rtol=0)


CASES = [  # bits, group_size, desc_act, checkpoint_format, quantized head, settings file
    pytest.param(4, 32, False, "gptq", False, "config.json", id="int4-g32"),
    pytest.param(4, 32, True, "gptq", False, "config.json", id="int4-g32-act-order"),
    pytest.param(8, 32, False, "gptq", False, "config.json", id="int8-g32"),
    pytest.param(8, 32, True, "gptq", False, "quantize_config.json", id="int8-g32-act-order-autogptq-file"),
    pytest.param(4, 16, True, "gptq_v2", True, "config.json", id="int4-g16-act-order-v2-head"),
    pytest.param(8, -1, False, "gptq_v2", False, "config.json", id="int8-per-channel-v2"),
]


@pytest.mark.parametrize("bits,group_size,desc_act,checkpoint_format,head,settings_file", CASES)
def test_gptq_checkpoint_converts_to_its_dequantized_weights(tmp_path, smollm2_tokenizer, bits,
                                                             group_size, desc_act, checkpoint_format,
                                                             head, settings_file):
    reference = write_gptq_checkpoint(tmp_path / "gptq", tiny_llama(smollm2_tokenizer),
                                      smollm2_tokenizer, bits, group_size, desc_act,
                                      checkpoint_format, head, settings_file)
    source = open_source(str(tmp_path / "gptq"))
    assert isinstance(source, GPTQSource)
    expected = reference.state_dict()
    for name, shape in source.tensor_shapes().items():
        assert tuple(source.load(name).shape) == shape, name
    quantized = LINEARS + (("lm_head",) if head else ())
    for name in (n for n in expected if n.removesuffix(".weight").endswith(quantized)):
        tensors = {leaf: source.load(name.replace(".weight", f".quantized.{leaf}"))
                   for leaf in ("qweight", "scales", "biases", "g_idx")}
        assert tensors["qweight"].dtype == (torch.uint8 if bits == 4 else torch.int8)
        assert torch.equal(dequantize(**tensors, dtype=torch.float32), expected[name]), name
    model_dir = convert(str(tmp_path / "gptq"), tmp_path / "repo", dtype="float32")
    assert "quantization_config" not in json.loads((model_dir / "1" / "weights" / "config.json").read_text())
    with safe_open(model_dir / "1" / "weights" / "rank0.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_proj.quantized.qweight").get_dtype() \
            == ("U8" if bits == 4 else "I8")
    llm = LLM(str(model_dir), block_size=8, quantized_activations="float")  # the dequantized math
    assert_serves_reference(llm, reference, smollm2_tokenizer.vocab_size)


@pytest.mark.parametrize("change,message", [
    ({"bits": 3}, "3 bits"), ({"checkpoint_format": "marlin"}, "marlin"),
    ({"dynamic": {"+:.*down_proj": {"bits": 8}}}, "per-module"),
])
def test_unsupported_gptq_checkpoints_are_refused(tmp_path, smollm2_tokenizer, change, message):
    write_gptq_checkpoint(tmp_path / "gptq", tiny_llama(smollm2_tokenizer), smollm2_tokenizer,
                          4, 32, False, "gptq")
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=message):
        GPTQSource(tmp_path / "gptq")


def calibration_inputs(model, text_ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every decoder linear's inputs over the calibration sequences, float model."""
    inputs, hooks = {}, []
    for name, module in model.named_modules():
        if name.endswith(LINEARS):
            hooks.append(module.register_forward_pre_hook(
                lambda m, args, name=name: inputs.setdefault(name, []).append(args[0][0])))
    with torch.no_grad():
        for ids in text_ids:
            model(ids)
    for hook in hooks:
        hook.remove()
    return {f"{name}.weight": torch.cat(xs) for name, xs in inputs.items()}


def round_to_nearest(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """The baseline: each group of consecutive columns rounded on its own min/max (4 bits) or
    absmax (8 bits) grid, no error feedback."""
    size = group_size if group_size > 0 else weight.shape[1]
    groups = weight.reshape(weight.shape[0], -1, size)
    if bits == 8:
        scale = groups.abs().amax(-1, keepdim=True) / 127
        return torch.round(groups / scale).clamp(-128, 127).mul(scale).reshape(weight.shape)
    low, high = groups.amin(-1, keepdim=True).clamp(max=0), groups.amax(-1, keepdim=True).clamp(min=0)
    scale = (high - low) / 15
    zero = torch.round(-low / scale)
    return ((torch.round(groups / scale) + zero).clamp(0, 15) - zero).mul(scale).reshape(weight.shape)


def saved_tiny_llama(directory: Path, tokenizer) -> tuple[LlamaForCausalLM, list[str]]:
    model = tiny_llama(tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, [n for n in model.state_dict() if n.removesuffix(".weight").endswith(LINEARS)]


CALIBRATION_TEXT = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, -1)])
def test_gptq_reconstructs_calibration_outputs_better_than_rounding(tmp_path, smollm2_tokenizer,
                                                                    bits, group_size):
    model, names = saved_tiny_llama(tmp_path / "hf", smollm2_tokenizer)
    quantized = gptq_quantize(tmp_path / "hf", names, bits, group_size, CALIBRATION_TEXT,
                              sequence_length=64, max_sequences=8)
    inputs = calibration_inputs(model, calibration_sequences(smollm2_tokenizer, CALIBRATION_TEXT, 64, 8))
    weights = model.state_dict()
    for name in names:
        tensors = quantized[name]
        out_features, in_features = weights[name].shape
        assert tensors["qweight"].dtype == (torch.uint8 if bits == 4 else torch.int8)
        assert ("biases" in tensors) == (bits == 4)
        groups = in_features // group_size if group_size > 0 else 1
        assert tensors["scales"].shape == (out_features, groups)
        assert torch.bincount(tensors["g_idx"].long()).tolist() == [in_features // groups] * groups
        gptq = dequantize(**{"biases": None, **tensors}, dtype=torch.float32)
        rtn = round_to_nearest(weights[name], bits, group_size)
        x, w = inputs[name], weights[name]
        gptq_error = torch.linalg.norm(x @ (w - gptq).T)
        rtn_error = torch.linalg.norm(x @ (w - rtn).T)
        assert gptq_error < 0.95 * rtn_error, f"{name}: GPTQ {gptq_error:.4g} vs rounding {rtn_error:.4g}"
    for fused in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):  # engine-fused parts
        first, *rest = [n for n in names if n.startswith("model.layers.1.") and any(p in n for p in fused)]
        assert all(torch.equal(quantized[first]["g_idx"], quantized[n]["g_idx"]) for n in rest)


def test_gptq_measures_each_layer_on_the_quantized_layers_before_it(tmp_path, smollm2_tokenizer):
    model, names = saved_tiny_llama(tmp_path / "hf", smollm2_tokenizer)
    quantized = gptq_quantize(tmp_path / "hf", names, 4, 32, CALIBRATION_TEXT,
                              sequence_length=64, max_sequences=8)
    with torch.no_grad():
        for name in (n for n in names if n.startswith("model.layers.0.")):
            model.get_parameter(name).copy_(dequantize(**quantized[name], dtype=torch.float32))
    inputs = calibration_inputs(model, calibration_sequences(smollm2_tokenizer, CALIBRATION_TEXT, 64, 8))
    weights = model.state_dict()
    for name in (n for n in names if n.startswith("model.layers.1.")):
        hessian = 2 * inputs[name].T @ inputs[name] / len(inputs[name])
        expected = gptq_round(weights[name], hessian, Grid(4, symmetric=False), 32).storage(Grid(4, False))
        same = (quantized[name]["qweight"] == expected["qweight"]).float().mean()
        assert same > 0.99, f"{name}: {same:.1%} of the packed values agree"


def grid_rounding(weight: torch.Tensor, grid: Grid, size: int) -> torch.Tensor:
    """Each group of `size` consecutive columns rounded to nearest on the grid fit for it."""
    groups = []
    for group in weight.split(size, dim=1):
        scale, zero = grid.fit(group)
        groups.append(grid.dequantize(grid.round(group, scale[:, None], zero[:, None]),
                                      scale[:, None], zero[:, None]))
    return torch.cat(groups, dim=1)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_rounds_to_nearest_when_inputs_are_uncorrelated(bits):
    """With H = I there is no other column to carry an error to."""
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    grid = Grid(bits, symmetric=bits == 8)
    size = 32 if bits == 4 else -1
    storage = gptq_round(weight, torch.eye(64), grid, size).storage(grid)
    torch.testing.assert_close(dequantize(**{"biases": None, **storage}, dtype=torch.float32),
                               grid_rounding(weight, grid, 32 if bits == 4 else 64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_grid_ranges_fit_closer_than_the_full_range(bits):
    """Clipping the extremes of heavy-tailed weights (Student t) cuts the squared rounding error
    below that of the min/max (absmax) grid: by a tenth at 4 bits, a little at 8."""
    torch.manual_seed(0)
    weight = torch.distributions.StudentT(3.0).sample((64, 128))
    grid = Grid(bits, symmetric=bits == 8)
    fitted = (grid_rounding(weight, grid, 128) - weight).square().sum(1)
    full = (round_to_nearest(weight, bits, 128) - weight).square().sum(1)
    assert fitted.sum() < (0.9 if bits == 4 else 0.995) * full.sum()
    assert (fitted <= full * (1 + 1e-6)).float().mean() > 0.85


def test_fused_parts_quantized_in_different_column_groups_are_refused(tmp_path, smollm2_tokenizer):
    """q/k/v share their input, so act-order gives them one g_idx; the loader reads q's alone."""
    write_gptq_checkpoint(tmp_path / "gptq", tiny_llama(smollm2_tokenizer), smollm2_tokenizer,
                          4, 32, True, "gptq")
    tensors = load_file(tmp_path / "gptq" / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, tmp_path / "gptq" / "model.safetensors")
    with pytest.raises(ConversionError, match="different groups"):
        convert(str(tmp_path / "gptq"), tmp_path / "repo", dtype="float32")
