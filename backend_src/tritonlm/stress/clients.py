"""One streamed request over any of the served protocols, optionally cut (the connection closed,
the gRPC call cancelled) after a number of streamed events, as a client that goes away does."""
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
import grpc
import numpy as np
from tritonclient.grpc import service_pb2_grpc

from tritonlm.bench.serve_client import infer_request
from tritonlm_client._core import request_fields

PROTOCOLS = ("grpc", "http", "openai", "tgi")


@dataclass
class Outcome:
    """What a client saw: token ids (grpc, http), text, the first error and its HTTP status, the
    events received, whether it cut the stream, and the seconds to its end."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    error: str | None = None
    status: int | None = None
    events: int = 0
    cut: bool = False
    seconds: float = 0.0

    @property
    def refused(self) -> bool:
        """Refused for load (429 / UNAVAILABLE, which tritonserver words as overloaded)."""
        return self.status == 429 or (self.error is not None and "overloaded" in self.error)


async def _finish(call, timeout: float = 10.0) -> None:
    """Wait for the end the server gives a call after the request's last response, rather than
    closing the channel on it: tritonserver 2.51 cannot unload a model one of whose streams was
    cancelled just after its last response (its stop then waits out --exit-timeout-secs)."""
    try:
        await asyncio.wait_for(call.code(), timeout)
    except asyncio.TimeoutError:
        call.cancel()


@dataclass(frozen=True)
class Endpoints:
    grpc: str  # host:port
    http: str  # host:port
    frontend: str | None  # http://host:port
    model: str = "llm"


class Client:
    """Shared connections for many concurrent requests."""

    def __init__(self, endpoints: Endpoints):
        self.endpoints = endpoints
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                             connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        await self.session.close()

    async def stream(self, protocol: str, prompt: str | list[int], sampling: dict,
                     cut_after: int | None = None) -> Outcome:
        outcome, start = Outcome(), time.perf_counter()
        try:
            await getattr(self, f"_{protocol}")(prompt, sampling, cut_after, outcome)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            outcome.error = outcome.error or f"{type(exc).__name__}: {exc}"
        outcome.seconds = time.perf_counter() - start
        return outcome

    async def _grpc(self, prompt, sampling, cut_after, outcome: Outcome) -> None:
        fields = request_fields(prompt, stream=True, sampling=sampling)
        request = infer_request(self.endpoints.model, uuid.uuid4().hex, fields)

        async def requests():
            yield request

        async with grpc.aio.insecure_channel(self.endpoints.grpc) as channel:
            call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())
            try:
                async for response in call:
                    if response.error_message:
                        outcome.error = response.error_message
                        return await _finish(call)
                    result = response.infer_response
                    outcome.token_ids += _int64_output(result, "token_ids")
                    outcome.events += 1
                    final = result.parameters.get("triton_final_response")
                    if final is not None and final.bool_param:
                        return await _finish(call)
                    if cut_after is not None and outcome.events >= cut_after:
                        outcome.cut = True
                        call.cancel()
                        return
            except grpc.aio.AioRpcError as exc:
                outcome.error = f"{exc.code()}: {exc.details()}"

    async def _http(self, prompt, sampling, cut_after, outcome: Outcome) -> None:
        fields = request_fields(prompt, stream=True, sampling=sampling)
        url = f"http://{self.endpoints.http}/v2/models/{self.endpoints.model}/generate_stream"
        async for event in self._sse(url, fields, cut_after, outcome):
            if "error" in event:
                outcome.error = event["error"]
                return
            outcome.token_ids += _as_list(event.get("token_ids"))
            outcome.text += "".join(_as_list(event.get("text_output")))

    async def _openai(self, prompt, sampling, cut_after, outcome: Outcome) -> None:
        body = {"model": self.endpoints.model, "prompt": prompt, "stream": True, **sampling}
        url = f"{self.endpoints.frontend}/v1/completions"
        async for event in self._sse(url, body, cut_after, outcome):
            if "error" in event:
                outcome.error = str(event["error"].get("message", event["error"]))
                return
            outcome.text += "".join(c.get("text", "") for c in event.get("choices", []))

    async def _tgi(self, prompt, sampling, cut_after, outcome: Outcome) -> None:
        parameters = {"max_new_tokens": sampling.get("max_tokens", 16)}
        if sampling.get("temperature"):
            parameters.update(do_sample=True, temperature=sampling["temperature"])
        url = f"{self.endpoints.frontend}/generate_stream"
        async for event in self._sse(url, {"inputs": prompt, "parameters": parameters},
                                     cut_after, outcome):
            if "error" in event:
                outcome.error = event["error"]
                return
            outcome.text += (event.get("token") or {}).get("text", "")

    async def _sse(self, url: str, body: dict, cut_after: int | None, outcome: Outcome):
        """Each `data:` event's JSON; stops (closing the connection) after `cut_after` events."""
        async with self.session.post(url, json=body) as response:
            if response.status != 200:
                outcome.status = response.status
                text = await response.text()
                try:
                    error = json.loads(text).get("error", text)
                except (ValueError, AttributeError):
                    error = text
                outcome.error = str(error.get("message", error) if isinstance(error, dict)
                                    else error)
                return
            outcome.status = 200
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                outcome.events += 1
                yield json.loads(data)
                if cut_after is not None and outcome.events >= cut_after:
                    outcome.cut = True
                    response.close()
                    return


def _int64_output(result, name: str) -> list[int]:
    for index, output in enumerate(result.outputs):
        if output.name == name:
            return np.frombuffer(result.raw_output_contents[index], dtype=np.int64).tolist()
    return []


def _as_list(value) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]
