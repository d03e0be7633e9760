"""bfloat16 weights prepacked into oneDNN's layout compute what torch's F.linear computes on the
plain weights: the same greedy tokens and logprobs for SmolLM2."""
import pytest
import torch
import torch.nn.functional as F

from conftest import run_convert
from tritonlm import LLM, SamplingParams
from tritonlm.layers import cpu_gemm
from tritonlm.layers.linear import ColumnParallelLinear

pytestmark = pytest.mark.skipif(not cpu_gemm.can_prepack(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="this CPU has no native bfloat16 matmuls")


def test_prepacked_linear_equals_f_linear_and_keeps_its_dense_weight():
    torch.manual_seed(0)
    layer = ColumnParallelLinear(96, 160, bias=True).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    x = torch.randn(7, 96, dtype=torch.bfloat16)
    expected = F.linear(x, weight, layer.bias)
    layer.prepack_for_cpu(batch_hint=32)
    assert layer.weight is None and layer.packed is not None
    torch.testing.assert_close(layer(x), expected, rtol=1e-2, atol=1e-2)
    assert torch.equal(layer.dense_weight(torch.bfloat16), weight)
    assert layer(x[:1]).shape == (1, 160)  # any row count, whatever the hint


def test_bfloat16_engine_with_and_without_prepacking(tmp_path, smollm2_tokenizer, monkeypatch):
    repo = run_convert("default", tmp_path, "--dtype", "bfloat16")
    prompts = [smollm2_tokenizer.encode(text) for text in
               ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a")]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    packed = LLM(str(repo), num_kv_blocks=64)
    assert any(getattr(m, "packed", None) is not None for m in packed.engine.runner.model.modules())
    ours = packed.generate(prompts, params)
    monkeypatch.setattr(cpu_gemm, "can_prepack", lambda weight: False)
    reference = LLM(str(repo), num_kv_blocks=64).generate(prompts, params)
    for a, b in zip(ours, reference):
        assert a.token_ids == b.token_ids
        chosen = [entry["logprob"] for entry in a.logprobs]
        expected = [entry["logprob"] for entry in b.logprobs]
        assert chosen == pytest.approx(expected, abs=0.05)
