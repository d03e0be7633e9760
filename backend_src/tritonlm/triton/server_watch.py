"""Stops the engine when tritonserver unloads the model or exits while requests stream.

A decoupled model's execute() has returned long before its responses end, so tritonserver counts
no inference in flight: on SIGTERM or an unload it marks the model UNLOADING and waits for the
model's response factories to go (each request's last response), up to its exit timeout; the
model's finalize() comes only after. A long generation then outlived the server, and the backend
stub (which ignores SIGTERM) kept generating, reparented to init. So a thread asks tritonserver
whether the model is still ready and, once it is not (after having been; a stopping server
answers "Server not ready"), ends every request with an error at once and stops the engine; if
the server process itself is gone (killed), the stub exits at once.
"""
import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger("tritonlm")

# Soon after unloading starts tritonserver checks the stub's health, apparently killing a stub that
# does not answer within a second: a stub whose cores the engine kept busy died (the request's
# last response never sent, tritonserver waiting for it until its exit timeout) in 1 of 3 runs
# polled every 0.5 s, none of 7 at 0.1 s.
POLL_SECONDS = 0.1


class ServerWatch:
    def __init__(self, is_ready: Callable[[], bool], stop: Callable[[str], None],
                 exit_process: Callable[[], None] = lambda: os._exit(1)):
        """`is_ready`: whether tritonserver serves the model; `stop(reason)`: end every request
        with `reason` and stop the engine."""
        self._is_ready, self._stop, self._exit = is_ready, stop, exit_process
        self._parent = os.getppid()
        self._ended = threading.Event()
        # Apart: once tritonserver is gone (SIGKILL), a readiness query waits forever on its
        # reply, and so would responses sent to it: the parent watch exits without either.
        self._threads = [threading.Thread(target=watch, name=name, daemon=True) for watch, name
                         in ((self._watch_readiness, "tritonlm-server-watch"),
                             (self._watch_parent, "tritonlm-parent-watch"))]

    def start(self) -> None:
        """Start watching, once (later calls do nothing): from the first request, as before it
        there is nothing to cut short."""
        if self._threads[0].ident is None and not self._ended.is_set():
            for thread in self._threads:
                thread.start()

    def close(self) -> None:
        self._ended.set()

    def _watch_parent(self) -> None:
        while not self._ended.wait(POLL_SECONDS):
            if os.getppid() != self._parent:
                logger.error("tritonserver exited: this backend stub exits with it")
                self._exit()
                return

    def _watch_readiness(self) -> None:
        seen_ready = False
        while not self._ended.wait(POLL_SECONDS):
            try:
                ready = self._is_ready()
            except Exception:  # noqa: BLE001 - "Server not ready": tritonserver is stopping
                ready = False
            if ready:
                seen_ready = True
            elif seen_ready:
                logger.warning("the model is being unloaded: ending the requests in flight")
                self._stop("the model is being unloaded (tritonserver stops or unloads it); "
                           "the request was cut short")
                return
