"""`tritonlm-serve`: run the tritonserver bundled in the nvidia-pytriton wheel on a model repository.

The server gets a backend directory with the Python backend and the stub for this interpreter
(tritonlm.bundled_server), the wheel's libraries on LD_LIBRARY_PATH and this interpreter's bin/
first on PATH: the stub embeds libpython, which finds its prefix (so the venv's site-packages,
where tritonlm is installed) by looking up `python3` on PATH.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tritonlm.frontend_process import FrontendProcess, die_with_parent
from tritonlm.bundled_server import ServeError, backend_directory, check_libpython, pytriton_root
from tritonlm.tracing import ENDPOINT_VARIABLE
from tritonlm.triton.contract import EXPLICIT_CONTROL_VARIABLE

__all__ = ["ServeError", "build_command", "exit_timeout", "TritonServerProcess", "main"]

TRITON_EXIT_TIMEOUT = 30.0  # tritonserver's default --exit-timeout-secs
# tritonserver 2.51 does not exit while a gRPC client holds a ModelStreamInfer stream open, even an
# idle one: the model stays UNLOADING until --exit-timeout-secs, then tritonserver logs "Exiting
# immediately" and waits on the stream forever. tritonlm-serve kills it this many seconds after
# its exit timeout has passed.
KILL_GRACE = 5.0


def build_command(repo, http_port=8000, grpc_port=8001, metrics_port=8002, log_verbose=0,
                  extra_args=(), otlp_endpoint=None) -> tuple[list[str], dict[str, str]]:
    """argv and environment that run the bundled tritonserver on `repo`."""
    repo = Path(repo)
    if not repo.is_dir():
        raise ServeError(f"model repository {repo} is not a directory")
    root = pytriton_root()
    server = root / "tritonserver" / "bin" / "tritonserver"
    if not server.exists():
        raise ServeError(f"nvidia-pytriton lacks {server}")
    backends = backend_directory(root)
    env = dict(os.environ)
    libs = str(root.parent / "nvidia_pytriton.libs")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libs, env.get("LD_LIBRARY_PATH")]))
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
    check_libpython(backends / "python" / "triton_python_backend_stub", env)
    # Explicit model control lets a model whose engine died unload itself, i.e. report not ready.
    env[EXPLICIT_CONTROL_VARIABLE] = "1"
    if otlp_endpoint:
        env[ENDPOINT_VARIABLE] = otlp_endpoint
    argv = [str(server), f"--model-repository={repo.resolve()}", f"--backend-directory={backends}",
            f"--cache-directory={root / 'tritonserver' / 'caches'}",
            f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
            "--allow-metrics=true", f"--log-verbose={log_verbose}",
            "--exit-on-error=true", "--strict-readiness=true", "--disable-auto-complete-config",
            "--model-control-mode=explicit", "--load-model=*"]
    if not Path("/dev/nvidiactl").exists():
        argv.append("--allow-gpu-metrics=false")  # no NVML here: skip the DCGM/NVML probe
    return argv + list(extra_args), env


def exit_timeout(extra_args) -> float:
    """The --exit-timeout-secs that tritonserver gets in `extra_args` (its default if none)."""
    value = TRITON_EXIT_TIMEOUT
    for i, arg in enumerate(extra_args):
        if arg.startswith("--exit-timeout-secs="):
            value = float(arg.split("=", 1)[1])
        elif arg == "--exit-timeout-secs" and i + 1 < len(extra_args):
            value = float(extra_args[i + 1])
    return value


def _get_json(url: str, method: str = "GET", timeout: float = 2.0):
    req = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
        return json.loads(body) if body else None


class TritonServerProcess:
    """tritonserver as a child process (its own session, terminated if this process dies)."""

    def __init__(self, repo, http_port=8000, grpc_port=8001, metrics_port=8002, log_verbose=0,
                 extra_args=(), stdout=None, stderr=None, otlp_endpoint=None):
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.argv, self.env = build_command(repo, http_port, grpc_port, metrics_port, log_verbose,
                                            extra_args, otlp_endpoint)
        self._io = (stdout, stderr)
        self.exit_timeout = exit_timeout(extra_args)
        self.proc: subprocess.Popen | None = None
        self._stop_time: float | None = None  # time.monotonic() of the first stop signal

    def start(self) -> "TritonServerProcess":
        """Launch the server; returns at once (see wait_ready)."""
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._io[0], stderr=self._io[1],
                                     start_new_session=True, preexec_fn=die_with_parent)
        return self

    def is_ready(self) -> bool:
        """True when /v2/health/ready answers 200."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=1):
                return True
        except OSError:
            return False

    def wait_ready(self, timeout: float | None = None, poll: float = 0.25) -> bool:
        """Block until ready (True), the server exits (False) or `timeout` passes (TimeoutError)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.proc.poll() is None:
            if self.is_ready():
                return True
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"tritonserver not ready after {timeout}s")
            time.sleep(poll)
        return False

    def repository_index(self) -> list[dict]:
        """Entries of /v2/repository/index: name, version, state (READY, UNAVAILABLE...)."""
        return _get_json(f"http://127.0.0.1:{self.http_port}/v2/repository/index", "POST") or []

    def model_names(self) -> list[str]:
        """Names of the models in the repository index."""
        return [m["name"] for m in self.repository_index()]

    def send_signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL tritonserver and its backend stubs (its process group)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def request_stop(self, sig: int = signal.SIGTERM) -> None:
        """Forward a stop signal; a second one kills at once."""
        if self._stop_time is not None:
            self.kill()
            return
        self._stop_time = time.monotonic()
        self.send_signal(sig)

    def wait(self) -> int:
        """Wait for tritonserver to exit, killing it if it outlives its exit timeout + KILL_GRACE
        after request_stop (which a signal handler may call meanwhile); returns the exit code."""
        while True:
            try:
                return self.proc.wait(0.5)
            except subprocess.TimeoutExpired:
                if self._stop_time is None:
                    continue
                waited = time.monotonic() - self._stop_time
                if waited > self.exit_timeout + KILL_GRACE:
                    print(f"tritonlm-serve: tritonserver still runs {waited:.0f} s after the stop "
                          "signal (a gRPC client holds a stream open); killing it",
                          file=sys.stderr, flush=True)
                    self.kill()

    def stop(self) -> int:
        """SIGTERM, then wait; returns the exit code."""
        self.request_stop()
        return self.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tritonlm-serve", description=__doc__.splitlines()[0],
                                     epilog="Arguments after -- go to tritonserver unchanged.")
    parser.add_argument("--model-repository", required=True, type=Path)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--frontend-port", type=int, default=8080,
                        help="port of the OpenAI / TGI HTTP front end and chat page (default 8080)")
    parser.add_argument("--no-frontend", action="store_true", help="serve Triton's endpoints only")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--otlp-endpoint", metavar="URL",
                        help="export request traces over OTLP/HTTP (e.g. http://host:4318/v1/traces)")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1:]
    try:
        server = TritonServerProcess(args.model_repository, args.http_port, args.grpc_port,
                                     args.metrics_port, args.log_verbose, extra,
                                     otlp_endpoint=args.otlp_endpoint)
    except ServeError as err:
        print(f"tritonlm-serve: error: {err}", file=sys.stderr)
        return 2
    frontend = None if args.no_frontend else FrontendProcess(
        args.model_repository, args.frontend_port, args.grpc_port, args.metrics_port)

    def stop(sig, _frame):
        if frontend is not None:
            frontend.request_stop()  # it closes its streams, then Triton's requests end
        server.request_stop(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    server.start()
    if frontend is not None:
        frontend.start()
    if server.wait_ready() and (frontend is None or frontend.wait_ready()):
        try:
            models = ", ".join(m["name"] + ("" if m.get("state") == "READY" else
                                            f" ({m.get('state') or 'not loaded'})")
                               for m in server.repository_index()) or "(none)"
        except OSError:
            models = "(unknown)"
        print(f"tritonlm-serve: ready\n  HTTP    http://127.0.0.1:{args.http_port}\n"
              f"  gRPC    127.0.0.1:{args.grpc_port}\n  metrics http://127.0.0.1:{args.metrics_port}/metrics\n"
              + ("" if frontend is None else
                 f"  OpenAI / TGI API and chat page  http://127.0.0.1:{args.frontend_port}\n")
              + f"  models  {models}", flush=True)
        code = server.wait()
    elif server.proc.poll() is None:
        print("tritonlm-serve: the HTTP front end did not become ready", file=sys.stderr)
        server.stop()
        code = 1
    else:
        code = server.proc.returncode
        print(f"tritonlm-serve: tritonserver exited with code {code} before becoming ready", file=sys.stderr)
        code = code or 1
    if frontend is not None:
        frontend.stop()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
