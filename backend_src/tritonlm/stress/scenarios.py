"""The stress scenarios of issue 28, each against a running server, each returning a report whose
`ok` says whether what it proves held."""
import asyncio
import random
import statistics
import time

from tritonlm.stress.clients import Client, Outcome
from tritonlm.stress.probes import MetricsProbe, grew, usage

PREEMPTIONS = "tritonlm:num_preemptions_total"
FAST = 1.0  # seconds: a refusal is at most this slow, accepted latency at most this over twice normal
WORDS = ("river", "stone", "light", "paper", "garden", "signal", "winter", "engine", "story",
         "market", "cloud", "music", "bridge", "forest", "letter", "window")


def text_prompts(count: int, rng: random.Random, words=(4, 40)) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(count)]


async def gather_limited(jobs, concurrency: int) -> list:
    """Await each coroutine of `jobs`, at most `concurrency` at once, results in order."""
    limit = asyncio.Semaphore(concurrency)

    async def one(job):
        async with limit:
            return await job
    return await asyncio.gather(*(one(job) for job in jobs))


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    return {"count": len(values), "p50": round(statistics.median(ordered), 4),
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4)}


async def kv_pressure(client: Client, probe: MetricsProbe, prompts: list[list[int]],
                      output_len: int) -> dict:
    """Every stream at once against a KV cache sized for a few sequences, then each alone:
    all complete, the same greedy tokens, preemptions counted, the gauges back at idle."""
    sampling = {"temperature": 0, "max_tokens": output_len, "ignore_eos": True}
    before = probe.samples().get(PREEMPTIONS, 0)
    start = time.perf_counter()
    loaded = await asyncio.gather(*(client.stream("grpc", p, sampling) for p in prompts))
    loaded_seconds = time.perf_counter() - start
    preemptions = probe.samples().get(PREEMPTIONS, 0) - before
    alone = [await client.stream("grpc", p, sampling) for p in prompts]
    errors = [o.error for o in loaded + alone if o.error is not None]
    mismatches = [(i, _first_difference(a.token_ids, b.token_ids))
                  for i, (a, b) in enumerate(zip(loaded, alone)) if a.token_ids != b.token_ids]
    short = sum(len(o.token_ids) != output_len for o in loaded)
    idle = probe.wait_idle()
    return {"scenario": "kv-pressure", "streams": len(prompts), "output_len": output_len,
            "loaded_seconds": round(loaded_seconds, 2), "errors": errors[:5],
            "error_count": len(errors), "mismatches": len(mismatches),
            "mismatched_at": mismatches[:10],  # (stream, first differing token)
            "short": short,
            "preemptions": preemptions, "idle_gauges": idle,
            "ok": not errors and not mismatches and not short and preemptions > 0
            and not any(idle.values())}


async def settled_usage(pids: list[int], seconds: float = 3.0):
    await asyncio.sleep(seconds)  # closed connections' threads and sockets wind down
    return usage(pids)


async def warmed_idle_usage(client: Client, probe: MetricsProbe, pids: list[int],
                            protocols: list[str], concurrency: int):
    """Idle usage once every protocol has run at `concurrency`: thread pools and kept-alive
    connections as steady use has them, the baseline a leak shows against."""
    sampling = {"max_tokens": 4}
    await gather_limited([client.stream(p, "warm up", sampling)
                          for p in protocols for _ in range(concurrency)], concurrency)
    probe.wait_idle()
    return await settled_usage(pids)


async def cut_streams(client: Client, probe: MetricsProbe, pids: list[int], count: int,
                      protocols: list[str], output_len: int, concurrency: int,
                      rng: random.Random) -> dict:
    """`count` streams over `protocols`, each cut after a random number of events: no KV block
    stays in use, the gauges return to idle, and threads and fds to their idle counts."""
    sampling = {"temperature": 0, "max_tokens": output_len, "ignore_eos": True}
    prompts = text_prompts(count, rng)
    idle_before = await warmed_idle_usage(client, probe, pids, protocols, concurrency)
    jobs = [client.stream(protocols[i % len(protocols)], prompt, sampling,
                          cut_after=rng.randint(1, max(1, output_len // 2)))
            for i, prompt in enumerate(prompts)]
    start = time.perf_counter()
    outcomes = await gather_limited(jobs, concurrency)
    seconds = time.perf_counter() - start
    gauges = probe.wait_idle()
    idle_after = await settled_usage(pids)
    errors = [o.error for o in outcomes if o.error is not None]
    return {"scenario": "cut-streams", "streams": count, "protocols": protocols,
            "seconds": round(seconds, 2), "cut": sum(o.cut for o in outcomes),
            "error_count": len(errors), "errors": errors[:5], "idle_gauges": gauges,
            "idle_before": idle_before.as_dict(), "idle_after": idle_after.as_dict(),
            "ok": not errors and not any(gauges.values()) and not grew(idle_before, idle_after)}


async def _timed_load(client: Client, rate: float, seconds: float, sampling: dict,
                      rng: random.Random, pids: list[int]) -> tuple[list[Outcome], int]:
    """Poisson arrivals at `rate` per second for `seconds`; the outcomes and the peak RSS."""
    tasks, peak = [], 0
    end = time.perf_counter() + seconds
    next_sample = 0.0
    while time.perf_counter() < end:
        prompt = text_prompts(1, rng)[0]
        tasks.append(asyncio.create_task(client.stream("grpc", prompt, sampling)))
        if time.perf_counter() >= next_sample:
            peak, next_sample = max(peak, usage(pids).rss_bytes), time.perf_counter() + 1.0
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks)), peak


async def overload(client: Client, probe: MetricsProbe, pids: list[int], capacity: int,
                   seconds: float, multiple: float, output_len: int,
                   rng: random.Random) -> dict:
    """Load at `multiple` times what the server finishes at `capacity` requests in flight: the
    accepted requests keep their latency, the excess is refused fast, memory stays bounded."""
    sampling = {"temperature": 0, "max_tokens": output_len, "ignore_eos": True}
    idle = usage(pids)
    start = time.perf_counter()
    calibration = await gather_limited(
        [client.stream("grpc", p, sampling) for p in text_prompts(capacity * 8, rng)], capacity)
    throughput = len(calibration) / (time.perf_counter() - start)
    outcomes, peak = await _timed_load(client, throughput * multiple, seconds, sampling, rng,
                                       pids)
    accepted = [o for o in outcomes if o.error is None]
    refused = [o for o in outcomes if o.refused]
    other = [o.error for o in outcomes if o.error is not None and not o.refused]
    calibrated = _percentiles([o.seconds for o in calibration if o.error is None])
    served = _percentiles([o.seconds for o in accepted])
    refusals = _percentiles([o.seconds for o in refused])
    gauges = probe.wait_idle()
    return {"scenario": "overload", "capacity": capacity, "seconds": seconds,
            "offered_per_second": round(throughput * multiple, 2),
            "capacity_per_second": round(throughput, 2), "offered": len(outcomes),
            "calibration_latency": calibrated, "accepted_latency": served,
            "refused": len(refused), "refusal_latency": refusals,
            "other_errors": other[:5], "other_error_count": len(other),
            "rss_mib_idle": round(idle.rss_bytes / 2**20, 1),
            "rss_mib_peak": round(peak / 2**20, 1), "idle_gauges": gauges,
            "ok": not other and bool(refused) and bool(accepted)
            and served["p99"] <= 2 * calibrated["p99"] + FAST
            and refusals["p99"] < FAST and not any(gauges.values())}
