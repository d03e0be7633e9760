"""Start the real tritonserver (through the `tritonlm-serve` console script) for tests.

    with start_server(repo) as server:
        client = Client(server.grpc_url, model="llm")

The server runs in its own process group with stdout/stderr in `server.log_path`; a test that
fails can print `server.logs()`.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tritonlm.ports import free_ports

SERVE = Path(sys.executable).parent / "tritonlm-serve"


class ServerStartError(RuntimeError):
    """The server exited or timed out before becoming ready; the message holds its log tail."""


@dataclass
class RunningServer:
    http_url: str  # "127.0.0.1:PORT", the form tritonclient takes
    grpc_url: str
    metrics_url: str
    frontend_url: str  # "http://127.0.0.1:PORT", the OpenAI / TGI front end
    log_path: Path
    process: subprocess.Popen

    def logs(self) -> str:
        """Everything the launcher and tritonserver have written so far."""
        return self.log_path.read_text(errors="replace")

    def models(self) -> list[str]:
        """Model names from the repository index."""
        req = urllib.request.Request(f"http://{self.http_url}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=5) as resp:
            return [m["name"] for m in json.load(resp)]


def _ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=1):
            return True
    except OSError:
        return False


def _frontend_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1):
            return True
    except OSError:
        return False


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM the launcher's group (it forwards to tritonserver), then SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        # tritonserver gets SIGTERM from the kernel when the launcher dies (PR_SET_PDEATHSIG)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


PORT_CLASH = "already in use"  # gRPC: "Address already in use", HTTP: "Socket '...' already in use"


def _launch(repo_path, log_path: Path, log_verbose: int, extra_args, timeout: float,
            stop_timeout: float) -> RunningServer:
    """tritonlm-serve on free ports, waited for until ready; stopped again if it is not."""
    http, grpc, metrics, frontend = free_ports(4)
    argv = [str(SERVE), "--model-repository", str(repo_path), "--http-port", str(http),
            "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--frontend-port", str(frontend),
            "--log-verbose", str(log_verbose), "--", *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = RunningServer(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"127.0.0.1:{metrics}",
                           f"http://127.0.0.1:{frontend}", log_path, proc)
    try:
        deadline = time.monotonic() + timeout
        while not (_ready(server.http_url) and _frontend_ready(server.frontend_url)):
            if proc.poll() is not None:
                raise ServerStartError(f"tritonlm-serve exited with code {proc.returncode} before ready; "
                                       f"log {log_path}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"tritonlm-serve not ready after {timeout}s; log {log_path}:\n"
                                       f"{_tail(log_path)}")
            time.sleep(0.25)
    except BaseException:
        _stop(proc, stop_timeout)
        raise
    return server


@contextlib.contextmanager
def start_server(repo_path, timeout: float = 300.0, log_path=None, log_verbose: int = 0,
                 extra_args=("--exit-timeout-secs=5",), stop_timeout: float = 30.0,
                 attempts: int = 3) -> Iterator[RunningServer]:
    """Launch tritonlm-serve on free ports, wait until ready, yield a RunningServer, stop it on exit.
    A port picked free can be taken before tritonserver binds it (tensor-parallel ranks open
    ephemeral ports while the model loads): the launch is then retried on other ports."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    for attempt in range(1, attempts + 1):
        try:
            server = _launch(repo_path, log_path, log_verbose, extra_args, timeout, stop_timeout)
            break
        except ServerStartError:
            if attempt == attempts or PORT_CLASH not in log_path.read_text(errors="replace"):
                raise
    try:
        yield server
    finally:
        _stop(server.process, stop_timeout)
