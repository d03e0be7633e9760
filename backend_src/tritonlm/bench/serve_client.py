"""Load against a running tritonserver: every request streamed over gRPC (ModelStreamInfer) or
HTTP Server-Sent Events (generate_stream), sent at a Poisson rate or kept at a fixed concurrency,
with each streamed token's arrival time recorded."""
import asyncio
import json
import random
import time
import uuid

import aiohttp
import tritonclient.grpc.aio as grpc_aio
from tritonclient.utils import InferenceServerException

from tritonlm.bench.metrics import RequestRecord
from tritonlm.bench.workloads import BenchRequest
from tritonlm_client._core import RETURN_FLAGS, parse_outputs, request_fields
from tritonlm_client.grpc_client import infer_input, is_final_response


def _fields(request: BenchRequest) -> dict:
    """Streamed greedy generation; of the optional outputs only token_ids, to count tokens."""
    sampling = {"max_tokens": request.output_len, "temperature": 0, "ignore_eos": True}
    fields = request_fields(request.prompt_token_ids, stream=True, sampling=sampling)
    return {name: value for name, value in fields.items()
            if name not in RETURN_FLAGS or name == "return_token_ids"}


class GrpcStreamer:
    def __init__(self, url: str, model: str):
        self.client = grpc_aio.InferenceServerClient(url)
        self.model = model

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        inputs = [infer_input(name, value) for name, value in _fields(request).items()]

        async def one_request():
            yield {"model_name": self.model, "inputs": inputs, "request_id": uuid.uuid4().hex,
                   "enable_empty_final_response": True}

        try:
            async for result, error in self.client.stream_infer(one_request()):
                if error is not None:
                    record.error = str(error)
                    return
                tokens = result.as_numpy("token_ids")
                if tokens is not None and tokens.size:
                    record.add_tokens(int(tokens.size), time.perf_counter())
                if is_final_response(result):
                    return
        except InferenceServerException as exc:
            record.error = str(exc)

    async def close(self) -> None:
        await self.client.close()


class SseStreamer:
    def __init__(self, url: str, model: str):
        self.endpoint = f"http://{url}/v2/models/{model}/generate_stream"
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             connector=aiohttp.TCPConnector(limit=0))

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        async with self.session.post(self.endpoint, json=_fields(request)) as response:
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


async def run_load(requests: list[BenchRequest], url: str, model: str, protocol: str,
                   concurrency: int | None = None, request_rate: float | None = None,
                   seed: int = 0, on_done=lambda: None) -> tuple[list[RequestRecord], float]:
    """Send every request; at most `concurrency` in flight, or arrivals at `request_rate` per
    second (Poisson; inf sends all at once). Returns the records and the run's duration."""
    streamer = (GrpcStreamer if protocol == "grpc" else SseStreamer)(url, model)
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
