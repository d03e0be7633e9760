"""dtype "auto" (the converter's default): the engine picks the weight dtype where it loads
(bfloat16 on CPUs with a packed bfloat16 matmul, else float32; on GPUs the checkpoint's half
dtype) and says which in its log, its metrics and the front end's /info."""
import os
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import linked_repository
from tritonlm import LLM, SamplingParams
from tritonlm.engine.auto_dtype import resolve_dtype
from tritonlm.layers import cpu_kernels

PROMPT = [1, 504, 3458, 282, 4649, 314]


def expected_cpu_dtype(kernels_on: bool = True) -> str:
    """From what the CPU has: tritonlm's kernels multiply bfloat16 with AVX2 + FMA or AVX512,
    and PyTorch's oneDNN has a bfloat16 matmul of its own on AVX512 (and AMX) CPUs."""
    flags = set(cpu_kernels.cpu_flags().split())
    if kernels_on and ({"avx2", "fma"} <= flags or "avx512f" in flags):
        return "bfloat16"
    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def test_auto_loads_the_weights_in_the_dtype_this_cpu_runs_fastest(smollm2_repo):
    with LLM(str(smollm2_repo), dtype="auto", num_kv_blocks=16) as llm:
        expected = expected_cpu_dtype(cpu_kernels.load() is not None)
        assert llm.engine.config.dtype == expected
        assert {p.dtype for p in llm.engine.runner.model.parameters()} == {getattr(torch, expected)}


def test_without_the_kernels_an_avx2_cpu_gets_float32(smollm2_repo):
    script = ("import logging, sys; from tritonlm import LLM; logging.basicConfig(level='INFO'); "
              "print(LLM(sys.argv[1], dtype='auto', num_kv_blocks=16).engine.config.dtype)")
    result = subprocess.run([sys.executable, "-c", script, str(smollm2_repo)], check=True,
                            capture_output=True, text=True,
                            env={**os.environ, "TRITONLM_CPU_KERNELS": "0"})
    assert result.stdout.split()[-1] == expected_cpu_dtype(kernels_on=False)
    assert "dtype auto: " in result.stderr


@pytest.mark.parametrize("stored, bf16_supported, expected", [
    (torch.bfloat16, True, "bfloat16"), (torch.float16, True, "float16"),
    (torch.float32, True, "bfloat16"), (torch.float32, False, "float16"),
    (torch.bfloat16, False, "bfloat16")])
def test_on_cuda_the_checkpoint_half_dtype_or_the_gpu_best(monkeypatch, stored, bf16_supported,
                                                           expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
    config = SimpleNamespace(dtype=stored)
    assert resolve_dtype("auto", torch.device("cuda", 0), config) == expected


def test_an_explicit_dtype_is_kept():
    config = SimpleNamespace(dtype=torch.bfloat16)
    assert resolve_dtype("float32", torch.device("cpu"), config) == "float32"
    assert resolve_dtype("float16", torch.device("cuda", 0), config) == "float16"


@pytest.mark.server
def test_served_auto_reports_its_choice_and_serves_it(smollm2_repo, tmp_path):
    from tritonlm_client import Client
    from triton_server import start_server
    expected = expected_cpu_dtype(os.environ.get("TRITONLM_CPU_KERNELS", "1") != "0")
    repo = linked_repository(smollm2_repo, tmp_path / "repo", dtype="auto", num_kv_blocks=16,
                             max_model_len=128)
    with start_server(repo) as server:
        info = httpx.get(f"{server.frontend_url}/info").json()
        assert info["model_dtype"] == expected
        metrics = httpx.get(f"http://{server.metrics_url}/metrics").text
        labels = [sample.labels for family in text_string_to_metric_families(metrics)
                  for sample in family.samples if sample.name == "tritonlm:model_config_info"]
        assert [(lab["model"], lab["dtype"]) for lab in labels] == [("llm", expected)]
        assert f"dtype auto: {expected}" in server.logs()
        with Client(server.grpc_url) as client:
            served = client.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(smollm2_repo), dtype=expected, num_kv_blocks=16) as llm:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        assert served.token_ids == llm.generate(PROMPT, params)[0].token_ids
