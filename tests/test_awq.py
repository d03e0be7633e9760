"""AutoAWQ GEMM checkpoints (W4A16, LMDeploy's --model-format awq): packed by AutoAWQ's own
WQLinear_GEMM.from_linear, converted, and served token-exact against transformers with the
weights AutoAWQ's dequantize_gemm gives."""
import importlib.util
import json
import sys

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from family_check import TINY_LLAMA, random_prompts, reference_greedy, save_tiny
from tritonlm import LLM, SamplingParams
from tritonlm_convert.convert import convert
from tritonlm_convert.errors import ConversionError

GROUP_SIZE = 32
NEW_TOKENS = 16


def autoawq():
    """AutoAWQ's packing and dequantization modules (its package __init__ imports its model zoo
    and calibration datasets, which these do not need)."""
    if "awq" not in sys.modules:
        spec = importlib.util.find_spec("awq")
        if spec is None:
            pytest.skip("autoawq is not installed")
        sys.modules["awq"] = importlib.util.module_from_spec(spec)
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm
    return WQLinear_GEMM, dequantize_gemm


def zero_point_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's zero-point grouping of a weight [out, in] (its pseudo_quantize_tensor): scales
    and zeros [in / GROUP_SIZE, out], the scales fp16-exact."""
    groups = weight.reshape(-1, GROUP_SIZE)
    low, high = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
    scales = ((high - low).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(low / scales)).clamp(0, 15)
    return (scales.view(weight.shape[0], -1).T.contiguous(),
            zeros.view(weight.shape[0], -1).T.contiguous())


def save_awq(model: LlamaForCausalLM, directory) -> dict[str, torch.Tensor]:
    """Every decoder linear layer of `model` as an AutoAWQ GEMM checkpoint in `directory`;
    returns the weights AutoAWQ dequantizes them to, by name."""
    WQLinear_GEMM, dequantize_gemm = autoawq()
    tensors, dequantized = {}, {}
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            tensors[name] = tensor.half()
            continue
        linear = model.get_submodule(module)
        scales, zeros = zero_point_groups(linear.weight.detach())
        packed = WQLinear_GEMM.from_linear(linear, 4, GROUP_SIZE, scales=scales, zeros=zeros)
        for leaf in ("qweight", "qzeros", "scales"):
            tensors[f"{module}.{leaf}"] = getattr(packed, leaf).contiguous()
        dequantized[name] = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales.float(),
                                            4, GROUP_SIZE).T.contiguous()
    save_file(tensors, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE,
                                     "zero_point": True, "version": "gemm"}
    (directory / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory, smollm2_tokenizer):
    directory = tmp_path_factory.mktemp("awq")
    config = LlamaConfig(**TINY_LLAMA, vocab_size=len(smollm2_tokenizer))
    model = save_tiny(directory, LlamaForCausalLM, config, smollm2_tokenizer)
    (directory / "model.safetensors").unlink()
    dequantized = save_awq(model, directory)
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict({**model.state_dict(), **dequantized})
    return directory, reference


def test_awq_checkpoint_serves_what_transformers_does_with_its_dequantized_weights(
        tmp_path, awq_checkpoint):
    directory, reference = awq_checkpoint
    model_dir = convert(str(directory), tmp_path / "repo", dtype="float32")
    assert 'string_value: "awq-int4"' in (model_dir / "config.pbtxt").read_text()
    prompts = random_prompts(3, reference.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), block_size=8, quantized_activations="float") as llm:
        outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [reference_greedy(reference, p, NEW_TOKENS)
                                              for p in prompts]


def test_awq_layouts_tritonlm_cannot_serve_are_refused(tmp_path, awq_checkpoint):
    directory, _ = awq_checkpoint
    config = json.loads((directory / "config.json").read_text())
    for change in ({"version": "gemv"}, {"bits": 8}, {"zero_point": False}):
        (directory / "config.json").write_text(json.dumps(
            {**config, "quantization_config": {**config["quantization_config"], **change}}))
        with pytest.raises(ConversionError, match="AWQ checkpoints of 4 bits"):
            convert(str(directory), tmp_path / "refused", dtype="float32")
    (directory / "config.json").write_text(json.dumps(config))
