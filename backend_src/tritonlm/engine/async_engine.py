"""Runs the engine's step loop on its own thread; requests come in from any thread and results
go out through per-request callbacks, called on a sender thread so that the step loop never
waits on the transport (nor on observers that report through it: see `observe`), nor on
questions of cancellation (engine/cancellation_watch.py)."""
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tritonlm.engine.cancellation_watch import CancellationWatch
from tritonlm.engine.llm_engine import LLMEngine, Request
from tritonlm.engine.request_state import RequestOutput
from tritonlm.engine.stats import EngineObserver, FinishedRequest, StepStats
from tritonlm.errors import EngineFatalError, InvalidRequestError, OverloadedError
from tritonlm.thread_names import ENGINE_THREAD, name_this_thread

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]
# A step failing this often in a row is a broken engine, not a bad batch.
MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass
class _Handle:
    request: Request
    on_output: OutputCallback


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]):
        """`engine`, or a function that builds it on the step-loop thread when `start` runs.

        Build it there when serving: libgomp keeps a pool of worker threads per thread that has
        started a parallel region, and once the pools hold more threads than there are cores it
        stops spinning between regions. An engine loaded on one thread and stepped on another
        ran every step about 40% slower on 2 cores (each small op paying a futex wake-up)."""
        self.engine = engine if isinstance(engine, LLMEngine) else None
        self._make_engine = None if isinstance(engine, LLMEngine) else engine
        self._built: queue.SimpleQueue = queue.SimpleQueue()  # None, or why building failed
        self._lock = threading.Condition()
        self._incoming: list[_Handle] = []
        self._aborts: list[str] = []
        self._cancels: list[str] = []
        self._active: dict[str, _Handle] = {}
        # Submitted requests whose last output is not sent yet (guarded by _lock): the count
        # max_concurrent_requests bounds.
        self._in_flight: set[str] = set()
        self._stopping = False
        self._stop_error: str | None = None  # what requests in flight at shutdown are told
        self._ended = threading.Event()  # set when the engine loop has ended
        self.death: Exception | None = None  # why the loop died, if it did
        # Called on the engine thread once if the loop dies (not on shutdown).
        self.on_death: Callable[[Exception], None] | None = None
        self._thread = threading.Thread(target=self._loop, name=ENGINE_THREAD, daemon=True)
        # (handle, output), or (an observer's method, its argument); None ends it
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="tritonlm-sender",
                                        daemon=True)
        self._cancellations = CancellationWatch(self._ended, self._cancel)

    def start(self) -> None:
        """Start the threads; with an engine to build, return once it is built (or raise why it
        could not be)."""
        self._sender.start()
        self._cancellations.thread.start()
        self._thread.start()
        if self._make_engine is not None and (error := self._built.get()) is not None:
            self._thread.join()
            self._sender.join()
            self._cancellations.thread.join()
            raise error

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: Request, on_output: OutputCallback,
               is_cancelled: Callable[[], bool] | None = None) -> None:
        """Queue a prepared request; `on_output` runs on the sender thread for every delta, in
        order; if it raises, the request is aborted. Raises OverloadedError when
        max_concurrent_requests are in flight already."""
        with self._lock:
            if self._stopping:
                raise RuntimeError(f"the engine has stopped: {self.death}" if self.death
                                   else "the engine is shutting down")
            limit = self.engine.config.max_concurrent_requests
            if len(self._in_flight) >= limit:
                raise OverloadedError(f"the model is overloaded: {limit} requests are in flight "
                                      "(max_concurrent_requests); retry later")
            self._in_flight.add(request.request_id)
            handle = _Handle(request, on_output)
            self._incoming.append(handle)
            if is_cancelled is not None:
                self._cancellations.watch(request.request_id, is_cancelled)
            self._lock.notify()

    def observe(self, observer: EngineObserver) -> None:
        """Add an engine observer whose calls run on the sender thread, in order with the
        outputs: a request is counted before its last output goes, and an observer that waits
        on a transport (Triton's metric API: a round trip to the server per call) never holds up
        the step loop."""
        self.engine.observers.append(_OnSender(observer, self._outbox.put))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify()

    def shutdown(self, timeout: float = 30.0, error: str | None = None) -> None:
        """Stop the loop; requests still in flight end with finish_reason 'abort', or with
        `error`."""
        with self._lock:
            self._stopping = True
            self._stop_error = error
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._sender.is_alive():
            self._sender.join(timeout)
        self._cancellations.thread.join(timeout)
        if self.engine is not None:
            self.engine.shutdown(step_running=self._thread.is_alive())

    def _loop(self) -> None:
        name_this_thread()  # before the engine's first parallel region: its workers inherit it
        try:
            if self._make_engine is not None:
                try:
                    self.engine = self._make_engine()
                except BaseException as exc:  # noqa: BLE001 - start() re-raises it
                    self._built.put(exc)
                    return
                self._built.put(None)
            self._loop_until_stopped()
        finally:
            self._ended.set()
            self._outbox.put(None)  # the sender delivers what is queued, then ends

    def _loop_until_stopped(self) -> None:
        try:
            self._run()
        except Exception as exc:
            logger.exception("the engine loop died with %d requests in flight; the model stops "
                             "serving", len(self._active))
            self.death = exc
            self._fail_all(f"the engine has stopped: {exc}", stopping=True)
            if self.on_death is not None:
                self.on_death(exc)
            return
        self._fail_all(self._stop_error, stopping=True)

    def _run(self) -> None:
        failures = 0
        while True:
            with self._lock:
                while not (self._stopping or self._incoming or self._aborts or self._cancels
                           or self._active):
                    self._lock.wait()
                if self._stopping:
                    break
                incoming, self._incoming = self._incoming, []
                aborts, self._aborts = self._aborts, []
                cancels, self._cancels = self._cancels, []
            for handle in incoming:
                self._admit(handle)
            for request_id in cancels:
                if request_id in self._active:
                    self.engine.report_error("cancelled")
                    self._abort(request_id)
            for request_id in aborts:
                self._abort(request_id)
            try:
                outputs = self.engine.step()
            except EngineFatalError:
                raise
            except Exception as exc:  # a failed step fails its requests, not the server
                failures += 1
                if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                    raise RuntimeError(f"{failures} engine steps failed in a row") from exc
                logger.exception("engine step failed")
                self._fail_all(f"internal error in the engine step: {exc}")
                continue
            failures = 0
            for output in outputs:
                self._deliver(output)

    def _admit(self, handle: _Handle) -> None:
        try:
            self.engine.add(handle.request)
        except Exception as exc:
            self.engine.report_error("invalid" if isinstance(exc, InvalidRequestError) else "internal")
            self._send(handle, _error_output(handle.request, str(exc)))
            return
        self._active[handle.request.request_id] = handle

    def _cancel(self, request_ids: list[str]) -> None:
        with self._lock:
            self._cancels.extend(request_ids)
            self._lock.notify()

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        if output is not None:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        handle = self._active.get(output.request_id)
        if handle is None:
            return
        if output.finished:
            del self._active[output.request_id]
        self._send(handle, output)

    def _send(self, handle: _Handle, output: RequestOutput) -> None:
        self._outbox.put((handle, output))

    def _send_loop(self) -> None:
        name_this_thread()
        while (item := self._outbox.get()) is not None:
            target, value = item
            if isinstance(target, _Handle):
                self._send_output(target, value)
                continue
            try:
                target(value)
            except Exception:
                logger.exception("an engine observer failed")

    def _send_output(self, handle: _Handle, output: RequestOutput) -> None:
        if output.finished:
            self._cancellations.forget(output.request_id)
            with self._lock:
                self._in_flight.discard(output.request_id)
        try:
            handle.on_output(output)
        except Exception:
            logger.exception("delivering output for request %s failed", output.request_id)
            if not output.finished:
                self.abort(output.request_id)

    def _fail_all(self, error: str | None, stopping: bool = False) -> None:
        """End every active request: with `error`, or as aborted when error is None;
        `stopping`: the loop ends, so requests submitted but not admitted yet fail too."""
        if stopping:
            with self._lock:
                self._stopping = True
                self._incoming, handles = [], self._incoming
            for handle in handles:
                self._send(handle, _error_output(handle.request,
                                                 error or "the engine is shutting down"))
        for request_id in list(self._active):
            output = self.engine.abort(request_id)
            handle = self._active.pop(request_id)
            if error is not None:
                self.engine.report_error("internal")
                self._send(handle, _error_output(handle.request, error))
            elif output is not None:
                self._send(handle, output)
            else:  # the engine had finished it: its last output went out already
                with self._lock:
                    self._in_flight.discard(request_id)


class _OnSender:
    """An observer's calls, queued for the sender thread."""

    def __init__(self, observer: EngineObserver, post: Callable[[tuple], None]):
        self._observer, self._post = observer, post

    def on_step(self, stats: StepStats) -> None:
        self._post((self._observer.on_step, stats))

    def on_request_finished(self, request: FinishedRequest) -> None:
        self._post((self._observer.on_request_finished, request))

    def on_request_error(self, kind: str) -> None:
        self._post((self._observer.on_request_error, kind))


def _error_output(request: Request, error: str) -> RequestOutput:
    return RequestOutput(request.request_id, [], True, len(request.prompt_token_ids), error=error)
