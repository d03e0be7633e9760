"""On a host with AVX512, the CPU kernels built without it (TRITONLM_CPU_AVX512=0: the AVX2 + FMA
variants that hosts without AVX512 run) pass the same kernel tests against PyTorch; on a host with
AVX512-VNNI, the quantized matmul built without VNNI (TRITONLM_CPU_VNNI=0: AVX512 hosts such as
Skylake-SP) passes its tests."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tritonlm.layers import cpu_kernels

KERNEL_TESTS = ["test_cpu_gemm.py", "test_cpu_kernels_fused.py", "test_cpu_kernels_prefill.py",
                "test_decode_attention_kernels.py", "test_quantized_matmul.py", "test_shortlist_head.py"]
# Tests in those files that run the kernels through SmolLM2 rather than over the shape classes:
# left to the main run and to hosts without the feature (31 of the AVX2 rerun's 44 s here).
WHOLE_MODEL_TESTS = [
    "test_cpu_gemm.py::test_bfloat16_engine_as_close_to_float32_with_prepacking_as_without",
    "test_shortlist_head.py::test_smollm2_shortlist_gives_transformers_greedy_tokens"]


@pytest.mark.parametrize("switch,flag,attribute,value,tests", [  # the build's attribute says
    ("TRITONLM_CPU_AVX512", "avx512f", "vector_lanes", "8", KERNEL_TESTS),
    ("TRITONLM_CPU_VNNI", "avx512_vnni", "has_vnni_dot_products", "False",
     ["test_quantized_matmul.py"])], ids=["avx2", "avx512-without-vnni"])
def test_kernels_built_without_a_feature_pass_the_kernel_tests(switch, flag, attribute, value,
                                                               tests):
    if flag not in cpu_kernels.cpu_flags().split():
        pytest.skip(f"no {flag} here: the other kernel tests already run the variants without it")
    here = Path(__file__).parent
    env = {**os.environ, switch: "0"}
    built = subprocess.run(
        [sys.executable, "-c", "from tritonlm.layers import cpu_kernels; "
         f"print(cpu_kernels.load().{attribute})"], env=env, capture_output=True, text=True)
    assert built.stdout.split()[-1:] == [value], built.stderr[-2000:]
    # Our OpenAI-Triton kernels' tests (run on numpy by Triton's interpreter here) do not touch
    # the CPU build: 58% of the AVX2 rerun's time, left to the main run.
    deselected = [f"--deselect=tests/{test}" for test in WHOLE_MODEL_TESTS]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *(str(here / name) for name in tests), "-k", "not triton", *deselected],
                         env=env, cwd=here.parent, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:]


def test_bf16_attention_passes_its_tests_multiplying_the_other_way():
    """With AVX512-BF16, decode attention reads a bf16 cache with dot products or widened for
    FMAs, whichever this CPU issues more FLOPs with (Zen 4: dot products; Intel Xeons: FMAs), and
    prefill attention multiplies in AMX tiles where the CPU has them; forced the other way
    (TRITONLM_BF16_MATMUL: dot products, no AMX), they pass their tests too."""
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.has_bf16_dot_products:
        pytest.skip("no AVX512-BF16 here: bf16 caches are widened, the only way")
    other = "dot" if kernels.bf16_dot_product_speedup() < 1 or kernels.has_amx_tiles else "fma"
    here = Path(__file__).parent
    files = [here / "test_decode_attention_kernels.py"]
    if kernels.has_amx_tiles:
        files.append(here / "test_cpu_kernels_prefill.py")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *map(str, files), "-k",
                          "(bfloat16 or half or two_threads) and not triton"],
                         env={**os.environ, "TRITONLM_BF16_MATMUL": other}, cwd=here.parent,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:]
