"""Where a served run's CPU goes: the cores each part of the system used over a timed run (psutil;
thread names from /proc). On a machine of few cores the served run's throughput is what the
engine's threads get after the others take theirs (2 cores, 32 streams: tritonserver, the stub's
IPC and the client took ~0.3 of them), so each served figure says what those others took:

- tritonserver: the server process itself (gRPC/HTTP, its side of the Python backend's IPC);
- engine: the threads of the model's stub named tritonlm-engine (the step loop, and its OpenMP
  workers, which inherit the name: thread_names.py);
- stub's other threads: the rest of the stub (the sender, the cancellation watch, Triton's IPC
  threads);
- front end: the HTTP front end's process, when one runs;
- client: this process (the load generator).

Beside them, how many of the engine's threads waited for a core on average (their run-queue time
from /proc/PID/task/TID/schedstat): where the others take their share in short bursts, each one
preempts an engine thread, and a parallel region then waits for it (2 AMX Xeon cores, 32 streams
of a token a response: ~0.3 threads, the served decode step ~1.3x offline's).

Linux only; an empty result elsewhere or once the server is gone."""
import time
from pathlib import Path

import psutil

from tritonlm.thread_names import ENGINE_THREAD

ENGINE_WAITING = "engine threads waiting for a core"
_SCHEDSTAT = Path("/proc/self/schedstat").exists()  # kernels without schedstats have none


def _seconds(times) -> float:
    return times.user + times.system


def _run_queue_seconds(pid: int, tid: int) -> float:
    """Seconds the thread has been runnable without a core (0 once it is gone, or where the
    kernel keeps no schedstat)."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


class CpuShares:
    """CPU seconds by part, for the server started as `server_pid` (and the front end as
    `frontend_pid`, if any), and this process."""

    def __init__(self, server_pid: int, frontend_pid: int | None = None):
        self.server_pid, self.frontend_pid = server_pid, frontend_pid

    def snapshot(self) -> dict[str, float]:
        """CPU seconds by part, and the engine threads' run-queue seconds under ENGINE_WAITING."""
        try:
            server = psutil.Process(self.server_pid)
            parts = {"tritonserver": _seconds(server.cpu_times()), "engine": 0.0,
                     "stub's other threads": 0.0, ENGINE_WAITING: 0.0}
            for stub in server.children():  # the backend stubs, one per model instance
                engine = [t for t in stub.threads()
                          if _thread_name(stub.pid, t.id) == ENGINE_THREAD]
                engine_seconds = sum(t.user_time + t.system_time for t in engine)
                parts["engine"] += engine_seconds
                parts["stub's other threads"] += _seconds(stub.cpu_times()) - engine_seconds
                parts[ENGINE_WAITING] += sum(_run_queue_seconds(stub.pid, t.id) for t in engine)
            if self.frontend_pid is not None:
                parts["front end"] = _seconds(psutil.Process(self.frontend_pid).cpu_times())
            parts["client"] = _seconds(psutil.Process().cpu_times())
        except psutil.Error:
            return {}
        return parts

    def measure(self, run):
        """run()'s result, the cores each part used while it ran (empty: not measurable) and the
        engine's threads waiting for a core on average (None: not measurable)."""
        before, start = self.snapshot(), time.perf_counter()
        result = run()
        seconds, after = time.perf_counter() - start, self.snapshot()
        if not before or not after or seconds <= 0:
            return result, {}, None
        rates = {part: round((after[part] - before[part]) / seconds, 3) for part in after}
        waiting = rates.pop(ENGINE_WAITING)
        return result, rates, waiting if _SCHEDSTAT else None
