"""Asks whether requests were cancelled, on a thread of its own: is_cancelled() may be a round trip
to another process (Triton's), so the step loop never waits on it."""
import logging
import threading
import time
from collections.abc import Callable

from tritonlm.thread_names import name_this_thread

logger = logging.getLogger(__name__)

# Asked this often (seconds) at most, and for no more than this share of the watcher's time (with
# hundreds of requests in flight a sweep of round trips takes a while), and no more questions a
# second than CANCEL_POLLS_PER_SECOND: each is a round trip through tritonserver that takes CPU
# from the engine on a small host (2 Zen 5 cores, 32 streams asked every 0.1 s: tritonserver
# 0.10 and the stub's other threads 0.07-0.08 cores; every 2 s: 0.07-0.08 and 0.05).
CANCEL_POLL_INTERVAL = 0.1
CANCEL_POLL_DUTY = 0.2
CANCEL_POLLS_PER_SECOND = 64


class CancellationWatch:
    """Sweeps the watched requests' is_cancelled() until `ended` is set, handing the ids of those
    cancelled to `on_cancelled`."""

    def __init__(self, ended: threading.Event, on_cancelled: Callable[[list[str]], None]):
        self._ended, self._on_cancelled = ended, on_cancelled
        self._watched: dict[str, Callable[[], bool]] = {}  # unfinished requests by id
        # NOTE: is_cancelled() is asked under this lock, and a request is forgotten under it
        # before its last output is sent: Triton frees a request's response factory once the
        # final response is sent, and is_cancelled() after that read freed memory (tritonserver
        # died in TRITONBACKEND_ResponseFactoryIsCancelled).
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="tritonlm-cancel-watch",
                                       daemon=True)

    def watch(self, request_id: str, is_cancelled: Callable[[], bool]) -> None:
        with self._lock:
            self._watched[request_id] = is_cancelled

    def forget(self, request_id: str) -> None:
        """Never ask about `request_id` again (returns after any question in progress)."""
        with self._lock:
            self._watched.pop(request_id, None)

    def _run(self) -> None:
        name_this_thread()
        pause = CANCEL_POLL_INTERVAL
        while not self._ended.wait(pause):
            with self._lock:
                watched = list(self._watched.items())
            started = time.monotonic()
            cancelled = [request_id for request_id, is_cancelled in watched
                         if self._asks_to_cancel(request_id, is_cancelled)]
            pause = max(CANCEL_POLL_INTERVAL, len(watched) / CANCEL_POLLS_PER_SECOND,
                        (time.monotonic() - started) * (1 - CANCEL_POLL_DUTY) / CANCEL_POLL_DUTY)
            if cancelled:
                self._on_cancelled(cancelled)

    def _asks_to_cancel(self, request_id: str, is_cancelled: Callable[[], bool]) -> bool:
        with self._lock:
            if self._watched.get(request_id) is not is_cancelled:
                return False  # its last output is sent: its cancellation state is gone
            try:
                return is_cancelled()
            except Exception:
                logger.exception("asking whether request %s was cancelled failed", request_id)
                return False
