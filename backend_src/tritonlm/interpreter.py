"""This environment's Python interpreter, for child processes started from any process."""
import sys
from pathlib import Path


def python_executable() -> str:
    """Inside Triton's backend stub sys.executable is the stub itself, not Python."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return str(Path(sys.prefix) / "bin" / "python3")
