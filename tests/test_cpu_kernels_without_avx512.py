"""On a host with AVX512, the CPU kernels built without it (TRITONLM_CPU_AVX512=0: the AVX2 + FMA
variants that hosts without AVX512 run) pass the same kernel tests against PyTorch."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tritonlm.layers import cpu_kernels

KERNEL_TESTS = ["test_cpu_gemm.py", "test_cpu_kernels_fused.py", "test_cpu_kernels_prefill.py",
                "test_decode_attention_kernels.py", "test_quantized_matmul.py"]


@pytest.mark.skipif("avx512f" not in cpu_kernels.cpu_flags().split(),
                    reason="no AVX512 here: the other kernel tests already run the AVX2 variants")
def test_kernels_built_without_avx512_pass_the_kernel_tests():
    here = Path(__file__).parent
    env = {**os.environ, "TRITONLM_CPU_AVX512": "0"}
    lanes = subprocess.run(
        [sys.executable, "-c", "from tritonlm.layers import cpu_kernels; "
         "print(cpu_kernels.load().vector_lanes)"], env=env, capture_output=True, text=True)
    assert lanes.stdout.split()[-1:] == ["8"], lanes.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *(str(here / name) for name in KERNEL_TESTS)],
                         env=env, cwd=here.parent, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:]
