"""Thread names the OS sees too (top -H, perf, /proc/<pid>/task/*/comm): Python 3.11 keeps a
thread's name to itself. A thread named before it starts its OpenMP pool passes the name on to
the pool's threads, so the engine's compute threads all show as tritonlm-engine."""
import ctypes
import threading

_PR_SET_NAME = 15
_NAME_BYTES = 15  # the kernel's limit, its NUL not counted
ENGINE_THREAD = "tritonlm-engine"  # the step loop's thread (engine/async_engine.py)


def name_this_thread() -> None:
    """Give the calling thread its Python name (the first 15 bytes) at the OS level."""
    try:
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):  # not Linux
        return
    prctl(_PR_SET_NAME, threading.current_thread().name.encode()[:_NAME_BYTES], 0, 0, 0)
