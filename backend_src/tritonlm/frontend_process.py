"""The HTTP front end (`tritonlm-frontend`, the OpenAI and TGI APIs) as a child process of
`tritonlm-serve`, pointed at the tritonserver it runs beside."""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


class FrontendProcess:
    def __init__(self, repo: Path, port: int, grpc_port: int | list[int], metrics_port: int, stdout=None,
                 stderr=None, routing: str | None = None):
        """`grpc_port`: one tritonserver's, or several replicas' (`routing` over them)."""
        self.port = port
        replicas = [grpc_port] if isinstance(grpc_port, int) else grpc_port
        self.argv = [sys.executable, "-m", "tritonlm_frontend.cli",
                     *(arg for p in replicas for arg in ("--triton-url", f"127.0.0.1:{p}")),
                     "--triton-metrics-url", f"http://127.0.0.1:{metrics_port}/metrics",
                     "--model-repository", str(Path(repo).resolve()), "--port", str(port)]
        if routing is not None:
            self.argv += ["--routing", routing]
        self._io = (stdout, stderr)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "FrontendProcess":
        self.proc = subprocess.Popen(self.argv, stdout=self._io[0], stderr=self._io[1],
                                     preexec_fn=die_with_parent)
        return self

    def is_ready(self) -> bool:
        """True when /health answers 200 (the front end is up and tritonserver ready)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                return True
        except OSError:
            return False

    def wait_ready(self, timeout: float = 60.0, poll: float = 0.25) -> bool:
        """Block until ready (True), or until it exits or `timeout` passes (False)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            if self.is_ready():
                return True
            time.sleep(poll)
        return False

    def request_stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (uvicorn closes open streams within 5 s), SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def die_with_parent() -> None:
    """In a child: get SIGTERM when the launcher dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
