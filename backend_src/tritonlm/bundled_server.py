"""Locate the tritonserver bundled in the nvidia-pytriton wheel and assemble its backend directory.

The wheel ships tritonserver, the Python backend and one backend stub per Python version; the
stub embeds the system libpython of that version. Used by `tritonlm.serve`; imports no pytriton.
"""
from __future__ import annotations

import ctypes.util
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PY_VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


class ServeError(RuntimeError):
    """The bundled server cannot be launched (missing wheel, stub or system library)."""


def pytriton_root() -> Path:
    """Directory of the installed `pytriton` package, found without importing it."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServeError("nvidia-pytriton is not installed: pip install 'tritonlm[serve]'")
    return Path(list(spec.submodule_search_locations)[0])


def _backend_files(root: Path) -> dict[str, Path]:
    py = root / "tritonserver" / "backends" / "python"
    stub = root / "tritonserver" / "python_backend_stubs" / PY_VERSION / "triton_python_backend_stub"
    if not py.is_dir():
        raise ServeError(f"nvidia-pytriton lacks the Python backend directory {py}")
    # The backend library and its Python utilities module, plus this interpreter's stub.
    files = {path.name: path for path in py.iterdir() if path.suffix in (".so", ".py")}
    files[stub.name] = stub
    if not any(name.endswith(".so") for name in files):
        raise ServeError(f"nvidia-pytriton lacks the Python backend library in {py}")
    for path in files.values():
        if not path.exists():
            raise ServeError(f"nvidia-pytriton lacks {path} (no Python backend stub for Python {PY_VERSION}?)")
    return files


def _links_ok(target: Path, files: dict[str, Path]) -> bool:
    return all((target / "python" / n).resolve() == p.resolve() for n, p in files.items())


def _build_links(parent: Path, target: Path, files: dict[str, Path]) -> None:
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=".build-"))
    try:
        (tmp / "python").mkdir()
        for name, path in files.items():
            (tmp / "python" / name).symlink_to(path.resolve())
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)  # atomic rename: readers see the old or the complete new dir
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def backend_directory(root: Path | None = None) -> Path:
    """A reusable backend directory (python/ holding symlinks into the wheel) for this interpreter."""
    root = root or pytriton_root()
    files = _backend_files(root)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tritonlm"
    key = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:12]
    for parent in (base, Path(tempfile.gettempdir()) / f"tritonlm-{os.getuid()}"):
        target = parent / f"backends-py{PY_VERSION}-{key}"
        if not _links_ok(target, files):
            try:
                _build_links(parent, target, files)
            except OSError:
                pass  # unwritable, or a concurrent launcher replaced it first
        if _links_ok(target, files):
            return target
    raise ServeError(f"cannot create a backend directory under {base} or {tempfile.gettempdir()}")


def check_libpython(stub: Path, env: dict) -> None:
    """Fail early when the system libpython the stub links against is missing."""
    if shutil.which("ldd"):
        out = subprocess.run(["ldd", str(stub)], env=env, capture_output=True, text=True).stdout
        missing = [ln.split()[0] for ln in out.splitlines() if "not found" in ln]
    else:
        missing = [] if ctypes.util.find_library(f"python{PY_VERSION}") else [f"libpython{PY_VERSION}"]
    if missing:
        hint = f" (apt-get install libpython{PY_VERSION})" if any("libpython" in m for m in missing) else ""
        raise ServeError(f"the Python backend stub needs {', '.join(missing)}{hint}")
