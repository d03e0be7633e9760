"""Stops the engine when tritonserver unloads the model or exits while requests stream.

A decoupled model's execute() has returned long before its responses end, so tritonserver counts
no inference in flight: on SIGTERM or an unload it marks the model UNLOADING and waits for the
model's response factories to go (each request's last response), up to its exit timeout; the
model's finalize() comes only after. A long generation then outlived the server, and the backend
stub (which ignores SIGTERM) kept generating, reparented to init. So a thread asks tritonserver
whether the model is still ready and, once it is not (after having been), ends every request
with an error at once and stops the engine; if the server process itself is gone (killed), a
reaper process kills the stub at once (`stub_reaper`).

The question goes to tritonserver's own HTTP endpoint, not through `pb_utils.is_model_ready`:
in the Python backend (2.51) a readiness query that the server answers with an error ("Server
not ready", as it does once stopping) frees the error message in shared memory while the stub
still reads it, and the stub died of that heap corruption in about 1 of 7 stops here.
"""
import logging
import os
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tritonlm.interpreter import python_executable
from tritonlm.thread_names import name_this_thread

logger = logging.getLogger("tritonlm")

# Soon after unloading starts tritonserver checks the stub's health, apparently killing a stub that
# does not answer within a second: a stub whose cores the engine kept busy died (the request's
# last response never sent, tritonserver waiting for it until its exit timeout) in 1 of 3 runs
# polled every 0.5 s, none of 7 at 0.1 s.
POLL_SECONDS = 0.1
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
_ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}


def server_http_url(argv: list[str]) -> str | None:
    """tritonserver's HTTP endpoint as a client on this host reaches it, from its command line;
    None where HTTP is turned off."""
    options: dict[str, str] = {}
    words = iter(argv[1:])
    for word in words:
        if word.startswith("--"):
            name, has_value, value = word[2:].partition("=")
            options[name] = value if has_value else next(words, "")
    if options.get("allow-http", "true").lower() in ("false", "off", "0"):
        return None
    address = options.get("http-address", "0.0.0.0")
    address = _ANY_ADDRESS.get(address, f"[{address}]" if ":" in address else address)
    return f"http://{address}:{options.get('http-port', '8000')}"


class ServerWatch:
    def __init__(self, model_name: str, stop: Callable[[str], None]):
        """`stop(reason)`: end every request with `reason` and stop the engine."""
        self._stop = stop
        self._ended = threading.Event()
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
        server = server_http_url(argv)
        self._ready_url = server and f"{server}/v2/models/{urllib.parse.quote(model_name)}/ready"
        self._thread = threading.Thread(target=self._watch_readiness, daemon=True,
                                        name="tritonlm-server-watch")
        self._reaper: subprocess.Popen | None = None

    def start(self) -> None:
        """Start watching, once (later calls do nothing): from the first request, as before it
        there is nothing to cut short."""
        if self._reaper is not None or self._ended.is_set():
            return
        self._reaper = subprocess.Popen(
            [python_executable(), "-m", "tritonlm.triton.stub_reaper", str(os.getppid()),
             str(os.getpid())], stdin=subprocess.DEVNULL)
        if self._ready_url is None:
            logger.warning("tritonserver serves no HTTP: requests in flight when it stops end "
                           "only once its exit timeout passes")
        else:
            self._thread.start()

    def close(self) -> None:
        """Stop watching readiness; the reaper stays until this process ends (finalizing a
        model can still meet a killed server)."""
        self._ended.set()
        if self._thread.ident is not None:
            self._thread.join()

    def _is_ready(self) -> bool:
        try:
            with _DIRECT.open(self._ready_url, timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):  # 400: not ready; refused: stopped
            return False

    def _watch_readiness(self) -> None:
        name_this_thread()
        seen_ready = False
        while not self._ended.wait(POLL_SECONDS):
            if self._is_ready():
                seen_ready = True
            elif seen_ready:
                logger.warning("the model is being unloaded: ending the requests in flight")
                self._stop("the model is being unloaded (tritonserver stops or unloads it); "
                           "the request was cut short")
                return
