"""Offline: every request handed to the engine in this process at once, token times taken as each
step returns."""
import time

from tritonlm.bench.metrics import RequestRecord
from tritonlm.bench.workloads import BenchRequest
from tritonlm.engine.llm_engine import LLMEngine
from tritonlm.sampling_params import SamplingParams


def greedy_params(output_len: int, lora_name: str | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                          lora_name=lora_name)


def warm_up(engine: LLMEngine, requests: list[BenchRequest]) -> None:
    """A short run first, so one-time costs (allocation, kernel selection) are not timed."""
    run_offline(engine, [BenchRequest(r.prompt_token_ids[:32], 4, r.lora_name)
                         for r in requests[:4]])
    engine.block_manager.reset_prefix_cache()


def run_offline(engine: LLMEngine, requests: list[BenchRequest], on_done=lambda: None,
                concurrency: int | None = None) -> tuple[list[RequestRecord], float]:
    """All requests at once, or `concurrency` at a time (the next added as one finishes)."""
    records: dict[str, RequestRecord] = {}
    pending = iter(enumerate(requests))

    def add_next() -> None:
        i, request = next(pending, (None, None))
        if request is not None:
            prepared = engine.make_request(f"bench-{i}", request.prompt_token_ids,
                                           greedy_params(request.output_len,
                                                         request.lora_name))
            engine.add(prepared)
            records[prepared.request_id] = RequestRecord(len(request.prompt_token_ids),
                                                         time.perf_counter())
    start = time.perf_counter()
    for _ in range(concurrency or len(requests)):
        add_next()
    while engine.has_unfinished:
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            record = records[output.request_id]
            record.error = output.error
            record.add_tokens(sum(len(s.token_ids) for s in output.sequences), now)
            if output.finished:
                on_done()
                add_next()
    return list(records.values()), time.perf_counter() - start
