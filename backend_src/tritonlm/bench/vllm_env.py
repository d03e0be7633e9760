"""The process environment vllm_runner.py gives vLLM: tcmalloc and Intel OpenMP preloaded (by
re-executing the runner), OpenMP threads bound to this process's CPUs, nothing downloaded; and
the HF model directory it reads. Like the runner, a standalone file: the standard library only
(psutil, a vLLM dependency, at most)."""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys

REEXEC_MARK = "TRITONLM_VLLM_RUNNER_REEXEC"

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "DO_NOT_TRACK": "1",
}


def _find_tcmalloc() -> str | None:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.strip().startswith("libtcmalloc_minimal.so.4 ") and "=>" in line:
                path = line.split("=>")[-1].strip()
                if os.path.exists(path):
                    return path
    except OSError:
        pass
    for pattern in (
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
        "/usr/lib64/libtcmalloc_minimal.so.4",
        "/usr/lib/libtcmalloc_minimal.so.4",
    ):
        if os.path.exists(pattern):
            return pattern
    return None


def _find_iomp() -> str | None:
    hits = glob.glob(os.path.join(sys.prefix, "lib", "libiomp5.so"))
    hits += glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "**", "libiomp5.so"),
                      recursive=True)
    return os.path.realpath(hits[0]) if hits else None


def reexec_with_preload(script: str, omp: str) -> None:
    """Re-exec `script` once with tcmalloc (and libiomp5 for omp == "iomp") in LD_PRELOAD."""
    if os.environ.get(REEXEC_MARK) == "1":
        return
    current = [p for p in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    needed = []  # (how to find it, what to say when it is missing)
    if not any("libtcmalloc" in p for p in current):
        needed.append((_find_tcmalloc, "libtcmalloc_minimal.so.4 not found (apt-get install "
                                       "libtcmalloc-minimal4); running without it"))
    has_omp = any(k in p for p in current for k in ("libiomp", "libomp", "libgomp"))
    if omp == "iomp" and not has_omp:
        needed.append((_find_iomp, "libiomp5.so not found in this venv (pip install "
                                   "intel-openmp); vLLM will use PyTorch's libgomp"))
    wanted = []
    for find, missing in needed:
        path = find()
        if path:
            wanted.append(path)
        else:
            print(f"vllm_runner: {missing}", file=sys.stderr)
    if not wanted:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(wanted + current)
    env[REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(script), *sys.argv[1:]], env)


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))


def _parse_cpu_list(spec: str) -> list[int]:
    """'0-1,4' -> [0, 1, 4]"""
    cpus: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        elif part:
            cpus.append(int(part))
    return cpus


def _cpu_range(cpus: list[int]) -> str:
    if cpus and cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])
    return ",".join(str(c) for c in cpus)


def cpu_snapshot() -> tuple[float, float] | None:
    """(CPU seconds used by the whole machine, by this process and its children), to tell how
    much of the machine other programs took during a timed run (Linux + psutil only)."""
    try:
        import psutil  # noqa: PLC0415 - a vLLM dependency

        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        me = psutil.Process()
        own = 0.0
        for proc in [me, *me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                own += t.user + t.system
            except psutil.Error:
                pass
        return busy, own
    except Exception:  # noqa: BLE001 - diagnostics only
        return None


def setup_env(args: argparse.Namespace) -> dict:
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    bind = args.threads_bind or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or _cpu_range(_allowed_cpus())
    if args.engine_process == "mp":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    else:
        # One process: vLLM binds OpenMP threads only in the worker processes it starts, so do
        # here what it would do there (vllm/utils/ompmultiprocessing.py), before torch loads.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        if bind != "nobind":
            cpus = _allowed_cpus() if bind == "auto" else _parse_cpu_list(bind)
            # Without it vLLM drops torch to 1 thread for "serving" (utils/torch_utils.py).
            os.environ.setdefault("OMP_NUM_THREADS", str(len(cpus)))
            if "libiomp" in os.environ.get("LD_PRELOAD", ""):
                os.environ.setdefault("KMP_AFFINITY", "granularity=fine,explicit,proclist=["
                                      + ",".join(map(str, cpus)) + "]")
                os.environ.setdefault("KMP_BLOCKTIME", "5")
                os.environ.setdefault("KMP_TPAUSE", "0")
            else:
                os.environ.setdefault("GOMP_CPU_AFFINITY", " ".join(map(str, cpus)))
        else:
            os.environ.setdefault("OMP_NUM_THREADS", str(len(_allowed_cpus())))
    if float(args.kv_cache_gib).is_integer():
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(args.kv_cache_gib))
    else:  # vLLM reads VLLM_CPU_KVCACHE_SPACE as an int and lets it override the engine arg
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    keys = sorted(set(OFFLINE_ENV) | {
        "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU",
        "VLLM_ENABLE_V1_MULTIPROCESSING", "LD_PRELOAD", "OMP_NUM_THREADS", "KMP_BLOCKTIME",
        "KMP_AFFINITY", "KMP_TPAUSE", "GOMP_CPU_AFFINITY",
    })
    return {k: os.environ[k] for k in keys if k in os.environ}


def hf_dir_for_vllm(weights_dir: str, dest: str) -> str:
    """Fill ``dest`` with symlinks to every file of tritonlm's ``weights_dir`` (config.json,
    tokenizer files, generation_config.json, ...), ``rank0.safetensors`` linked as
    ``model.safetensors``. Other ranks' shards are skipped. Idempotent. Returns ``dest``."""
    weights_dir = os.path.abspath(weights_dir)
    if not os.path.isfile(os.path.join(weights_dir, "rank0.safetensors")):
        raise FileNotFoundError(f"{weights_dir}/rank0.safetensors not found")
    if not os.path.isfile(os.path.join(weights_dir, "config.json")):
        raise FileNotFoundError(f"{weights_dir}/config.json not found")
    os.makedirs(dest, exist_ok=True)
    for name in sorted(os.listdir(weights_dir)):
        src = os.path.join(weights_dir, name)
        if not os.path.isfile(src):
            continue
        if name.startswith("rank") and name.endswith(".safetensors"):
            if name != "rank0.safetensors":
                continue
            name = "model.safetensors"
        link = os.path.join(dest, name)
        if os.path.islink(link) or os.path.exists(link):
            if os.path.islink(link) and os.readlink(link) == src:
                continue
            os.remove(link)
        os.symlink(src, link)
    return dest
