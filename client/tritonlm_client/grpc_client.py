"""gRPC client: Triton's decoupled streaming (ModelStreamInfer), for streaming and non-streaming."""
from __future__ import annotations

import queue
import threading
import uuid
from typing import Any, Iterator

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ._core import (FIELD_TYPES, BaseClient, Completion, TritonLMError, defaults_from_parameters,
                    parse_outputs)

_NUMPY = {"BYTES": np.object_, "INT64": np.int64, "BOOL": np.bool_}
_DONE = object()


def field_array(name: str, value: Any) -> np.ndarray:
    """A request field as the array of its Triton datatype (FIELD_TYPES[name])."""
    dtype = FIELD_TYPES[name]
    items = value if isinstance(value, list) else [value]
    if dtype == "BYTES":
        items = [v.encode("utf-8") if isinstance(v, str) else v for v in items]
    return np.array(items, dtype=_NUMPY[dtype])


def infer_input(name: str, value: Any) -> grpcclient.InferInput:
    array = field_array(name, value)
    tensor = grpcclient.InferInput(name, list(array.shape), FIELD_TYPES[name])
    tensor.set_data_from_numpy(array)
    return tensor


def is_final_response(result) -> bool:
    param = result.get_response().parameters.get("triton_final_response")
    return bool(param is not None and param.bool_param)


class Client(BaseClient):
    """tritonlm over gRPC. `url` is "host:port"; safe to share between threads."""

    def __init__(self, url: str = "localhost:8001", model: str = "llm", timeout: float | None = None,
                 verbose: bool = False):
        self.url, self.model, self.timeout, self.verbose = url, model, timeout, verbose
        self._idle: list[grpcclient.InferenceServerClient] = []  # one stream per tritonclient object
        self._lock = threading.Lock()

    def _acquire(self) -> grpcclient.InferenceServerClient:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return grpcclient.InferenceServerClient(self.url, verbose=self.verbose)

    def _release(self, conn: grpcclient.InferenceServerClient) -> None:
        with self._lock:
            self._idle.append(conn)

    def _responses(self, fields: dict[str, Any]) -> Iterator[Completion]:
        inputs = [infer_input(name, value) for name, value in fields.items()]
        results: queue.Queue = queue.Queue()
        conn = self._acquire()
        finished = False
        try:
            conn.start_stream(callback=lambda result, error: results.put((result, error)),
                              stream_timeout=self.timeout)
            conn.async_stream_infer(self.model, inputs, request_id=uuid.uuid4().hex,
                                    enable_empty_final_response=True)
            while not finished:
                result, error = results.get()
                if error is not None:
                    finished = True  # an error response is the request's last
                    raise TritonLMError(error.message() if hasattr(error, "message") else str(error))
                finished = is_final_response(result)
                names = [out.name for out in result.get_response().outputs]
                yield parse_outputs({name: result.as_numpy(name) for name in names})
        except InferenceServerException as err:
            if not results.empty():  # a failed stream reports its cause through the callback
                err = results.get()[1] or err
            finished = True
            raise TritonLMError(err.message()) from None
        finally:
            try:
                conn.stop_stream(cancel_requests=not finished)
            except InferenceServerException:
                conn = None
            if conn is not None:
                self._release(conn)

    def sampling_defaults(self) -> dict[str, Any]:
        """`default_<key>` parameters of the model's config (none: {})."""
        conn = self._acquire()
        try:
            config = conn.get_model_config(self.model, as_json=True)
        except InferenceServerException as err:
            raise TritonLMError(err.message()) from None
        finally:
            self._release(conn)
        return defaults_from_parameters(config.get("config", {}).get("parameters", {}))

    def close(self) -> None:
        """Close the idle gRPC channels."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
