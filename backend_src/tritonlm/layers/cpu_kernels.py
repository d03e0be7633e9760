"""tritonlm's C++ CPU kernels (csrc/): paged decode attention, which reads K/V blocks where they
lie in the cache with a streaming softmax, fused per-token ops (RMSNorm with its residual add,
activation-times-up, rotary embeddings, greedy argmax with the log-normaliser, a draft head's
shortlist argmax), and the write of a step's K/V rows into the cache.

Built once with torch.utils.cpp_extension (needs ninja and a C++ compiler) into
$TRITONLM_KERNEL_DIR (default ~/.cache/tritonlm/kernels/<torch version>), in a folder named by a
hash of the sources, the flags, torch's version and this CPU's features (the build uses
-march=native): `make setup` prebuilds it, and a server then imports the built module without
invoking ninja or the compiler. Concurrent builds are serialised by an flock, which the kernel
releases when a builder dies (cpp_extension's own lock file would then be left behind and make
every later build wait forever; a stale one is removed under the flock).
TRITONLM_CPU_KERNELS=0 turns the kernels off (`load` returns None): the PyTorch paths run.
TRITONLM_CPU_AVX512=0 builds them without AVX512 (`vector_lanes` 8, the AVX2 + FMA variants), so
a host with AVX512 can run what a host without it runs; TRITONLM_CPU_VNNI=0 likewise without
AVX512-VNNI (`has_vnni_dot_products` False: int8 inputs multiplied in AVX2's integer width).
"""
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# No FMA contraction: element-wise ops round each product, as the PyTorch ops they replace do.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off",
          *(["-mno-avx512f"] if os.environ.get("TRITONLM_CPU_AVX512", "1") == "0" else []),
          *(["-mno-avx512vnni"] if os.environ.get("TRITONLM_CPU_VNNI", "1") == "0" else [])]
LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
_loaded: dict[str, object] = {}


@functools.cache
def cpu_flags() -> str:
    """The "flags" line of /proc/cpuinfo (empty where there is none); read once."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build_dir() -> Path:
    root = (os.environ.get("TRITONLM_KERNEL_DIR")
            or Path.home() / ".cache/tritonlm/kernels" / torch.__version__)
    key = hashlib.sha256(b"\0".join([
        *(path.read_bytes() for path in SOURCES + HEADERS), " ".join(CFLAGS + LDFLAGS).encode(),
        torch.__version__.encode(), cpu_flags().encode()])).hexdigest()[:16]
    return Path(root) / f"tritonlm_cpu_kernels_{key}"



class Kernels:
    """The built extension: its kernels as torch ops (torch.ops.<extension name>, where dispatch
    modes see them: engine/op_programs.py records them), and the module's CPU features and
    OpProgram."""
    OPS = ("decode_attention", "prefill_attention", "rms_norm", "act_and_mul", "rotary_",
           "argmax_logsumexp", "shortlist_argmax", "write_kv_", "bf16_matmul", "quantized_matmul",
           "lora_add_")

    def __init__(self, module):
        self.module = module
        ops = getattr(torch.ops, module.__name__)
        for name in self.OPS:  # the overloads themselves: no overload resolution per call
            setattr(self, name, getattr(ops, name).default)

    def __getattr__(self, name: str):
        return getattr(self.module, name)


def _import(directory: Path) -> Kernels:
    library = directory / f"{directory.name}.so"
    spec = importlib.util.spec_from_file_location(directory.name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Kernels(module)


def build(verbose: bool = False):
    """Build (if not built yet) and import the extension; raises with the compiler's output."""
    directory = _build_dir()
    done = directory / "built"
    if done.exists():
        return _import(directory)
    from torch.utils import cpp_extension
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "w") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if done.exists():  # another process built it while we waited
            return _import(directory)
        (directory / "lock").unlink(missing_ok=True)  # cpp_extension's, left by a dead builder
        # After a failed build in this process cpp_extension would skip building and fail to
        # import; forgetting its record makes it run ninja (and report the compiler) again.
        cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(directory.name, None)
        path = os.environ.get("PATH", "")
        # ninja from the venv, when the interpreter runs without the venv activated.
        os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), path])
        try:
            module = cpp_extension.load(
                name=directory.name, sources=[str(p) for p in SOURCES], extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),  # copies: cpp_extension appends to them
                build_directory=str(directory), verbose=verbose)
        finally:
            os.environ["PATH"] = path
        done.touch()
        return Kernels(module)


def load():
    """The built extension, building it if needed; None (with one warning) when it cannot be
    built or imported, or is turned off. Never raises."""
    with _lock:
        if "module" not in _loaded:
            module = None
            if os.environ.get("TRITONLM_CPU_KERNELS", "1") != "0":
                try:
                    module = build()
                except Exception as e:  # noqa: BLE001 - any failure means: use the PyTorch path
                    logger.warning("CPU kernels unavailable, using the PyTorch paths: %s", e)
            _loaded["module"] = module
        return _loaded["module"]


def for_tensor(x: torch.Tensor):
    """The extension when its kernels can take x (a float tensor on the CPU), else None."""
    if x.device.type != "cpu" or x.dtype not in FLOAT_DTYPES:
        return None
    return _loaded["module"] if "module" in _loaded else load()


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_rows: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     alibi_slopes: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """q [B, Hq, D]; caches [R, bs, D] (the [num_blocks * Hkv, bs, D] view) of q's dtype;
    block_rows [B, Hkv, nb] and context_lens [B] int64 (the query at position context - 1);
    alibi_slopes [Hq] float32; window 0 or a sliding window -> [B, Hq, D]."""
    module = load()
    if module is None:
        raise RuntimeError("the CPU kernels could not be built (see the log)")
    return module.decode_attention(q, key_cache, value_cache, block_rows, context_lens, scale,
                                   alibi_slopes, window)
