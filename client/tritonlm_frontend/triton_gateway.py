"""The front end's only way to the engine: tritonserver's gRPC API through tritonclient's asyncio
client. One ModelStreamInfer call per request, so closing a request's iterator (its HTTP client
went away) cancels that call alone and Triton stops the request and frees its KV blocks."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import (InferenceServerException, deserialize_bytes_tensor,
                                serialize_byte_tensor, triton_to_np_dtype)

from tritonlm_client.grpc_client import field_array
from tritonlm_client._core import FIELD_TYPES

from .errors import APIError, from_triton_message


@dataclass
class GenerateRequest:
    """One generation in the Triton contract's terms (shared/design/triton-io.md)."""
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = True
    echo: bool = False  # the prompt's text before the first response's text
    logprobs: bool = False  # per generated token (sampling "logprobs" sets how many alternatives)
    request_id: str | None = None  # the client's X-Request-Id, which the engine's log shows

    def fields(self) -> dict[str, Any]:
        if self.messages is not None:
            fields: dict[str, Any] = {"messages": json.dumps(self.messages),
                                      "add_generation_prompt": self.add_generation_prompt}
            if self.chat_template_kwargs:
                fields["chat_template_kwargs"] = json.dumps(self.chat_template_kwargs)
        elif isinstance(self.prompt, str):
            fields = {"text_input": self.prompt}
        else:
            fields = {"input_ids": list(self.prompt or [])}
        fields.update(stream=self.stream, sampling_parameters=json.dumps(self.sampling),
                      exclude_input_in_output=not self.echo, return_finish_reason=True,
                      return_stop_reason=True, return_num_input_tokens=True,
                      return_num_output_tokens=True, return_token_ids=True,
                      return_cumulative_logprob=True, return_logprobs=self.logprobs)
        return fields


@dataclass
class SequenceDelta:
    """What one response added to one of the request's sequences."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict]  # one per token when logprobs were asked for
    finish_reason: str | None  # "stop", "length" or "abort" on the sequence's last response
    stop_reason: str | int | None  # the stop string or stop token id; None for EOS
    cumulative_logprob: float | None


@dataclass
class GenerateChunk:
    sequences: list[SequenceDelta]
    num_input_tokens: int | None
    prompt_logprobs: list[dict | None] | None
    final: bool


def _outputs(response) -> dict[str, np.ndarray]:
    """A ModelInferResponse's outputs by name, decoded from its raw contents."""
    arrays = {}
    for output, raw in zip(response.outputs, response.raw_output_contents):
        if output.datatype == "BYTES":
            arrays[output.name] = deserialize_bytes_tensor(raw)
        else:
            arrays[output.name] = np.frombuffer(raw, dtype=triton_to_np_dtype(output.datatype))
    return arrays


def _strings(outputs: dict, name: str) -> list[str]:
    array = outputs.get(name)
    return [] if array is None else [v.decode("utf-8") for v in array.reshape(-1)]


def _numbers(outputs: dict, name: str) -> list:
    array = outputs.get(name)
    return [] if array is None else array.reshape(-1).tolist()


def parse_response(response) -> GenerateChunk:
    """One Triton response (a ModelInferResponse) as a GenerateChunk."""
    outputs = _outputs(response)
    texts = _strings(outputs, "text_output")
    counts = _numbers(outputs, "num_output_tokens") or [0] * len(texts)
    reasons = _strings(outputs, "finish_reason")
    stop_reasons = [json.loads(r) for r in _strings(outputs, "stop_reason")]
    cumulative = _numbers(outputs, "cumulative_logprob")
    token_ids = _numbers(outputs, "token_ids")
    logprobs = [json.loads(e) for e in _strings(outputs, "logprobs")]
    prompt_logprobs = [json.loads(e) for e in _strings(outputs, "prompt_logprobs")]
    sequences, start = [], 0
    for index, text in enumerate(texts):
        end = start + int(counts[index])
        sequences.append(SequenceDelta(
            index, text, token_ids[start:end], logprobs[start:end] if logprobs else [],
            (reasons[index] or None) if index < len(reasons) else None,
            stop_reasons[index] if index < len(stop_reasons) else None,
            cumulative[index] if index < len(cumulative) else None))
        start = end
    num_input = _numbers(outputs, "num_input_tokens")
    final = response.parameters.get("triton_final_response")
    return GenerateChunk(sequences, int(num_input[0]) if num_input else None,
                         prompt_logprobs or None, bool(final and final.bool_param))


class ReplicaUnreachable(APIError):
    """tritonserver could not be reached, and the request got no response from it."""

    def __init__(self, url: str, details: str):
        super().__init__(503, f"tritonserver at {url} is unreachable: {details}")


def _infer_request(request: GenerateRequest, request_id: str) -> service_pb2.ModelInferRequest:
    infer = service_pb2.ModelInferRequest(model_name=request.model, id=request_id)
    # tritonclient's asyncio client cannot ask for this; without it a request whose last
    # response carries no outputs (a cancelled one) would never be seen to end.
    infer.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, value in request.fields().items():
        array = field_array(name, value)
        infer.inputs.add(name=name, datatype=FIELD_TYPES[name], shape=array.shape)
        infer.raw_input_contents.append(serialize_byte_tensor(array).item()
                                        if FIELD_TYPES[name] == "BYTES" else array.tobytes())
    return infer


class TritonGateway:
    """tritonserver at `url` ("host:port", its gRPC endpoint); shared by every route."""

    def __init__(self, url: str):
        self.url = url
        self._client: grpcclient.InferenceServerClient | None = None

    @property
    def client(self) -> grpcclient.InferenceServerClient:
        # NOTE: a grpc.aio channel belongs to the event loop running when it is made, so it is
        # made on first use, in the server's loop (create_app runs before uvicorn starts one).
        if self._client is None:
            self._client = grpcclient.InferenceServerClient(self.url)
            # Generation streams go through the same channel, as raw protobufs (_infer_request).
            self.stream_stub = service_pb2_grpc.GRPCInferenceServiceStub(self._client._channel)
        return self._client

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The request's responses until its final one. Raises APIError for a rejected or failed
        request; closing the iterator early cancels the request in Triton."""
        self.client  # the channel, made in this event loop
        infer = _infer_request(request, request.request_id or uuid.uuid4().hex)
        ended = asyncio.Event()

        async def one_request():
            yield infer
            await ended.wait()  # a half-closed stream would end the call before its responses

        call = self.stream_stub.ModelStreamInfer(one_request())
        finished = answered = False
        try:
            async for response in call:
                answered = True
                finished = bool(response.error_message)
                if finished:
                    raise from_triton_message(response.error_message)
                chunk = parse_response(response.infer_response)
                finished = chunk.final
                yield chunk
                if finished:
                    return
            finished = True
            raise APIError(502, "tritonserver ended the stream before the request's last response")
        except grpc.aio.AioRpcError as exc:
            finished = True
            if exc.code() == grpc.StatusCode.UNAVAILABLE and not answered:
                raise ReplicaUnreachable(self.url, exc.details()) from None
            raise from_triton_message(f"{exc.code().name}: {exc.details()}") from None
        finally:
            ended.set()
            if not finished:
                call.cancel()

    async def model_names(self) -> list[str]:
        """The names of the models Triton's repository index reports ready."""
        index = await self.client.get_model_repository_index(as_json=True)
        return [m["name"] for m in index.get("models", []) if m.get("state") == "READY"]

    async def model_config(self, model: str) -> dict:
        """A model's configuration as Triton serves it (config.pbtxt as JSON)."""
        return (await self.client.get_model_config(model, as_json=True)).get("config", {})

    async def is_ready(self) -> bool:
        try:
            return await self.client.is_server_ready()
        except InferenceServerException:
            return False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

