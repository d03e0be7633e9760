"""Load against a running tritonserver: every request streamed over gRPC (ModelStreamInfer), HTTP
Server-Sent Events (generate_stream), or through the HTTP front end (OpenAI's /v1/completions,
TGI's /generate_stream), sent at a Poisson rate or kept at a fixed concurrency, with each streamed
token's arrival time recorded."""
import asyncio
import json
import queue
import random
import threading
import time
import uuid

import aiohttp
import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor

from tritonlm.bench.metrics import RequestRecord
from tritonlm.bench.workloads import BenchRequest
from tritonlm_client._core import FIELD_TYPES, RETURN_FLAGS, parse_outputs, request_fields
from tritonlm_client.grpc_client import field_array


def _fields(request: BenchRequest, stream_interval: int) -> dict:
    """Streamed greedy generation; of the optional outputs only token_ids, to count tokens."""
    sampling = {"max_tokens": request.output_len, "temperature": 0, "ignore_eos": True}
    if stream_interval > 1:
        sampling["stream_interval"] = stream_interval
    fields = request_fields(request.prompt_token_ids, stream=True, sampling=sampling)
    return {name: value for name, value in fields.items()
            if name not in RETURN_FLAGS or name == "return_token_ids"}


class GrpcStreamer:
    """Every request on one bidirectional ModelStreamInfer stream (Triton tags each response with
    its request's id), responses read on a thread through grpc's synchronous API. A stream per
    request read through grpc's asyncio API cost the client 1.2-1.3x the CPU (32 x 128 tokens:
    0.65 s against 0.49-0.58 s), CPU the benchmark takes from the server on a shared machine."""

    def __init__(self, url: str, model: str, stream_interval: int):
        self.model = model
        self.stream_interval = stream_interval
        self.channel = grpc.insecure_channel(url)
        self.outgoing: queue.SimpleQueue = queue.SimpleQueue()  # requests; None ends the stream
        call = service_pb2_grpc.GRPCInferenceServiceStub(self.channel).ModelStreamInfer(
            iter(self.outgoing.get, None))
        self.waiting: dict[str, tuple[RequestRecord, asyncio.Future]] = {}
        self.ended: str | None = None  # why the stream ended, once it has
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.reader = threading.Thread(target=self._read, args=(call,), daemon=True)
        self.reader.start()

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        self.loop = asyncio.get_running_loop()
        done = self.loop.create_future()
        request_id = uuid.uuid4().hex
        with self.lock:
            if self.ended is not None:
                record.error = self.ended
                return
            self.waiting[request_id] = (record, done)
        fields = _fields(request, self.stream_interval)
        self.outgoing.put(infer_request(self.model, request_id, fields))
        await done

    def _read(self, call) -> None:
        try:
            for response in call:
                self._on_response(response)
            error = "the server ended the stream"
        except grpc.RpcError as exc:
            error = f"stream failed: {exc.code()}: {exc.details()}"
        with self.lock:  # whatever still waits will get no response
            waiting, self.waiting, self.ended = self.waiting, {}, error
        for record, done in waiting.values():
            record.error = error
            self.loop.call_soon_threadsafe(done.set_result, None)

    def _on_response(self, response) -> None:
        now = time.perf_counter()
        result = response.infer_response
        with self.lock:
            entry = self.waiting.get(result.id)
        if entry is None:
            return
        record, done = entry
        final = "triton_final_response" in result.parameters and \
            result.parameters["triton_final_response"].bool_param
        if response.error_message:
            record.error, final = response.error_message, True
        else:
            tokens = _count_int64(result, "token_ids")
            if tokens:
                record.add_tokens(tokens, now)
        if final:
            with self.lock:
                del self.waiting[result.id]
            self.loop.call_soon_threadsafe(done.set_result, None)

    async def close(self) -> None:
        self.outgoing.put(None)
        await asyncio.to_thread(self.reader.join)
        self.channel.close()


def infer_request(model: str, request_id: str, fields: dict) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, value in fields.items():
        array = field_array(name, value)
        request.inputs.add(name=name, datatype=FIELD_TYPES[name], shape=array.shape)
        request.raw_input_contents.append(serialize_byte_tensor(array).item()
                                          if FIELD_TYPES[name] == "BYTES" else array.tobytes())
    return request


def _count_int64(result, name: str) -> int:
    """Elements of the INT64 output `name` (0 when absent)."""
    for index, output in enumerate(result.outputs):
        if output.name == name:
            return len(result.raw_output_contents[index]) // 8
    return 0


class SseStreamer:
    def __init__(self, url: str, model: str, stream_interval: int):
        self.stream_interval = stream_interval
        self.endpoint = f"http://{url}/v2/models/{model}/generate_stream"
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             connector=aiohttp.TCPConnector(limit=0))

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        fields = _fields(request, self.stream_interval)
        async with self.session.post(self.endpoint, json=fields) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {await response.text()}"
                return
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    record.error = event["error"]
                    return
                tokens = parse_outputs(event).token_ids
                if tokens:
                    record.add_tokens(len(tokens), time.perf_counter())

    async def close(self) -> None:
        await self.session.close()


class OpenAIStreamer:
    """Streamed POST /v1/completions of the front end with the token-id prompt. Chunks carry text,
    not token ids: the usage chunk (stream_options.include_usage) gives the completion's tokens,
    and the chunks carry them as the engine streams, a chunk per token, or with stream_interval k
    the first token, then k per chunk, then the rest."""

    def __init__(self, url: str, model: str, stream_interval: int):
        self.model, self.stream_interval = model, stream_interval
        self.endpoint = f"{url.rstrip('/')}/v1/completions"
        self.session = _http_session()

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        body = {"model": self.model, "prompt": request.prompt_token_ids,
                "max_tokens": request.output_len, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.stream_interval > 1:
            body["stream_interval"] = self.stream_interval  # vLLM's extra key
        arrivals, completion_tokens = [], None
        async for event in _sse_events(self.session, self.endpoint, body, record):
            if event == "[DONE]":
                break
            if "error" in event:
                record.error = str(event["error"].get("message", event["error"]))
                return
            if event.get("choices"):
                arrivals.append(time.perf_counter())
            if event.get("usage"):
                completion_tokens = event["usage"]["completion_tokens"]
        if record.error is not None:
            return
        if completion_tokens is None:
            record.error = "the stream ended without its usage chunk"
            return
        sizes = chunk_sizes(completion_tokens, len(arrivals), self.stream_interval)
        if sizes is None:
            record.error = (f"{len(arrivals)} chunks cannot carry {completion_tokens} tokens "
                            f"at stream_interval {self.stream_interval}")
            return
        for size, at in zip(sizes, arrivals):
            record.add_tokens(size, at)

    async def close(self) -> None:
        await self.session.close()


def chunk_sizes(tokens: int, chunks: int, interval: int) -> list[int] | None:
    """Tokens per streamed chunk when `chunks` chunks carried `tokens`: one each, or as the
    engine streams at `interval` (the first token at once, `interval` per chunk, then the rest);
    None when neither fits."""
    if chunks == tokens:
        return [1] * chunks
    last = tokens - 1 - interval * (chunks - 2)
    if chunks < 2 or not 1 <= last <= interval:
        return None
    return [1] + [interval] * (chunks - 2) + [last]


class TgiStreamer:
    """Streamed POST /generate_stream (TGI's API) of the front end: an event per token. TGI takes
    text prompts only, so each prompt is the text of its token ids, trimmed until it encodes to
    about as many tokens (`prompt_text`, done before the run starts). TGI serves one model."""

    def __init__(self, url: str, requests: list[BenchRequest], prompt_text):
        self.endpoint = f"{url.rstrip('/')}/generate_stream"
        self.prompts = {id(r): prompt_text(r.prompt_token_ids) for r in requests}
        self.session = _http_session()

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        text, record.prompt_len = self.prompts[id(request)]
        body = {"inputs": text, "parameters": {
            "max_new_tokens": request.output_len, "details": False, "do_sample": False,
            "ignore_eos": True}}
        async for event in _sse_events(self.session, self.endpoint, body, record):
            if "error" in event:
                record.error = str(event["error"])
                return
            if event.get("token") is not None:
                record.add_tokens(1, time.perf_counter())

    async def close(self) -> None:
        await self.session.close()


def _http_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                 connector=aiohttp.TCPConnector(limit=0))


async def _sse_events(session: aiohttp.ClientSession, endpoint: str, body: dict,
                      record: RequestRecord):
    """The JSON value (or the bare string, as "[DONE]") of each `data:` line of the response; a
    refused request sets record.error and yields nothing."""
    async with session.post(endpoint, json=body) as response:
        if response.status != 200:
            record.error = f"HTTP {response.status}: {await response.text()}"
            return
        async for line in response.content:
            if line.startswith(b"data:"):
                data = line[5:].strip()
                yield data.decode() if data == b"[DONE]" else json.loads(data)


STREAMERS = {"grpc": GrpcStreamer, "http": SseStreamer, "openai": OpenAIStreamer}


async def run_load(requests: list[BenchRequest], url: str, model: str, protocol: str,
                   concurrency: int | None = None, request_rate: float | None = None,
                   seed: int = 0, on_done=lambda: None, stream_interval: int = 1,
                   prompt_text=None) -> tuple[list[RequestRecord], float]:
    """Send every request; at most `concurrency` in flight, or arrivals at `request_rate` per
    second (Poisson; inf sends all at once), each streamed a response per `stream_interval`
    tokens (tgi: a response per token, the prompt sent as `prompt_text(ids)`, a (text, its
    token count) pair). Returns the records and the run's duration."""
    if protocol == "tgi":
        streamer = TgiStreamer(url, requests, prompt_text)
    else:
        streamer = STREAMERS[protocol](url, model, stream_interval)
    limit = asyncio.Semaphore(concurrency or len(requests))
    rng = random.Random(seed)
    records: list[RequestRecord] = []

    async def one(request: BenchRequest) -> None:
        async with limit:
            record = RequestRecord(len(request.prompt_token_ids), time.perf_counter())
            records.append(record)
            await streamer.send(request, record)
            on_done()

    try:
        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(request)))
            if request_rate is not None and request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - start
    finally:
        await streamer.close()
