"""The Triton Python-backend model: translates between Triton requests and the engine.

`execute()` only validates and enqueues; the engine thread steps the batch and sends responses.
"""
import gc
import json
import logging
import os
import sys
import uuid
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from tritonlm.engine.async_engine import AsyncEngine
from tritonlm.engine.llm_engine import LLMEngine
from tritonlm.engine.request_state import RequestOutput
from tritonlm.errors import InvalidRequestError, OverloadedError
from tritonlm.tracing import RequestTracer, otlp_endpoint
from tritonlm.triton.contract import EXPLICIT_CONTROL_VARIABLE
from tritonlm.triton.metrics import TritonMetrics
from tritonlm.triton.request_parser import parse_request
from tritonlm.triton.response_builder import ResponseBuilder
from tritonlm.triton.server_watch import ServerWatch

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
logger = logging.getLogger("tritonlm")


def _error_response(message: str, code=None) -> "pb_utils.InferenceResponse":
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        _check_stub_reads_tensors()
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("tritonlm needs model_transaction_policy.decoupled")
        overrides = {}
        if args.get("model_instance_kind") == "GPU":
            overrides["device"] = f"cuda:{args['model_instance_device_id']}"
        model_dir = Path(args["model_repository"]) / args["model_version"]
        self.model_name = args["model_name"]
        # Built on the engine's own thread, where all its torch work runs (see AsyncEngine).
        self.async_engine = AsyncEngine(lambda: LLMEngine(model_dir, **overrides))
        self.async_engine.on_death = self._on_engine_death
        self.async_engine.start()
        self.engine = self.async_engine.engine
        config = self.engine.config
        self.async_engine.observe(TritonMetrics(
            self.model_name, args["model_version"], self.engine.max_model_len,
            {"dtype": config.dtype, "kv_cache_dtype": config.kv_cache_dtype,
             "device": str(self.engine.runner.device),
             "speculate": str(config.speculative_tokens if config.speculative else 0),
             "max_concurrent_requests": str(config.max_concurrent_requests),
             "max_input_tokens": str(self.engine.request_builder.max_input_tokens),
             "max_total_tokens": str(config.total_token_limit),
             **{name: str(getattr(config, name))
                for name in ("max_best_of", "max_stop_sequences", "max_top_n_tokens")}},
            config.max_loras if self.engine.runner.adapters else None))
        endpoint = otlp_endpoint(self.engine.config.otlp_endpoint)
        self.tracer = RequestTracer(endpoint) if endpoint else None
        if self.tracer is not None:
            self.async_engine.observe(self.tracer)
        self.server_watch = ServerWatch(self.model_name, self._stop_serving)
        logger.info("tritonlm serving %s in %s: %d KV blocks of %d tokens, max_model_len %d",
                    model_dir, config.dtype, self.engine.runner.num_blocks, config.block_size,
                    self.engine.max_model_len)

    def execute(self, requests):
        self.server_watch.start()
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._enqueue(request, sender)
            except InvalidRequestError as exc:
                self.engine.report_error("invalid")
                sender.send(_error_response(str(exc), pb_utils.TritonError.INVALID_ARG), flags=FINAL)
            except OverloadedError as exc:
                self.engine.report_error("overloaded")
                sender.send(_error_response(str(exc), pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
            except Exception as exc:
                logger.exception("could not enqueue a request")
                sender.send(_error_response(f"internal error: {exc}"), flags=FINAL)
        return None

    def _enqueue(self, request, sender) -> None:
        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        parsed = parse_request(get, request.parameters(), self.engine.sampling_defaults)
        request_id = f"{request.request_id() or 'req'}-{uuid.uuid4().hex[:12]}"
        prepared = self.engine.make_request(request_id, parsed.prompt, parsed.params,
                                            parsed.messages, parsed.add_generation_prompt,
                                            parsed.chat_template_kwargs)
        prepared.trace_parent = _trace_parent(request) if self.tracer is not None else None
        prepared.stream = parsed.stream
        prompt_text = prepared.prompt_text
        if prompt_text is None and not parsed.exclude_input_in_output:
            prompt_text = self.engine.tokenizer.decode(prepared.prompt_token_ids)
        builder = ResponseBuilder(parsed, prompt_text or "")

        def on_output(out: RequestOutput) -> None:
            flags = FINAL if out.finished else 0
            if out.error is not None:
                sender.send(_error_response(out.error), flags=FINAL)
            elif out.finished and sender.is_cancelled():
                sender.send(flags=FINAL)
            else:
                arrays = builder.on_output(out)
                tensors = [pb_utils.Tensor(name, value) for name, value in arrays.items()]
                sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)

        self.async_engine.submit(prepared, on_output, sender.is_cancelled)

    def _on_engine_death(self, exc: Exception) -> None:
        if os.environ.get(EXPLICIT_CONTROL_VARIABLE):
            logger.error("unloading model %s so that it reports not ready", self.model_name)
            pb_utils.unload_model(self.model_name)
        else:
            logger.error("model %s cannot mark itself not ready: the server does not run with "
                         "--model-control-mode=explicit; requests now get errors", self.model_name)

    def _stop_serving(self, reason: str) -> None:
        self.async_engine.shutdown(timeout=5.0, error=reason)

    def finalize(self):
        self.server_watch.close()
        self.async_engine.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()
        # The engine (its requests' response senders) and the metrics hold pb_utils objects, in
        # cycles with this model (bound methods) that only the interpreter's exit would free,
        # after the stub's shared memory is gone: each delete then crashed the stub, a segfault
        # at every stop. Free them while the stub still runs.
        vars(self).clear()
        gc.collect()


def _check_stub_reads_tensors() -> None:
    """Refuse to load where the backend stub cannot read tensors, instead of dying on a request.

    tritonserver 2.51's stub (nvidia-pytriton 0.7, NGC 24.10) builds its numpy arrays through a
    pybind11 older than NumPy 2's ABI: under NumPy 2 every array it makes holds the wrong bytes,
    and the first string input of a request kills the stub in deserialize_bytes_tensor.
    """
    probe = torch.arange(1, 5, dtype=torch.int32)
    read = pb_utils.Tensor.from_dlpack("probe", torch.utils.dlpack.to_dlpack(probe)).as_numpy()
    if read.tolist() != probe.tolist():
        raise pb_utils.TritonModelException(
            f"this tritonserver's Python backend stub reads tensors wrongly under NumPy "
            f"{np.__version__} (its pybind11 predates NumPy 2: a tensor of {probe.tolist()} read "
            f"as {read.tolist()}): install numpy<2 in the Python the stub embeds ({sys.prefix})")


def _trace_parent(request) -> str | None:
    """The W3C traceparent of Triton's own trace of this request, when Triton traces it."""
    context = request.trace().get_context()
    return json.loads(context).get("traceparent") if context else None
