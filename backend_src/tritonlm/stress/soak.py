"""Soak: mixed traffic for a long time (lengths, sampling options, several sequences, stop
strings, logprobs, cancellations, bad requests, over every protocol): no good request fails,
resident memory stops growing after warm-up, threads and fds end where they started."""
import asyncio
import random
import time

from tritonlm.stress.clients import Client
from tritonlm.stress.probes import MetricsProbe, grew, usage
from tritonlm.stress.scenarios import (WORDS, gather_limited, settled_usage, text_prompts,
                                       warmed_idle_usage)

WARM_UP_SHARE = 0.2  # of the run: memory is compared from its end on
MAX_RSS_DRIFT = 0.05
# Refused by every protocol (the front end ignores unknown keys, as vLLM's server does)
BAD_SAMPLING = ({"top_p": 5}, {"max_tokens": -1}, {"temperature": "hot"}, {"logprobs": 99},
                {"stop": [""]})


def mixed_request(rng: random.Random, protocols: list[str], max_tokens: int):
    """(protocol, prompt, sampling, cut_after, bad): one request of the mix."""
    protocol = rng.choice(protocols)
    prompt = text_prompts(1, rng, words=(1, 60))[0]
    sampling = {"max_tokens": rng.randint(1, max_tokens)}
    choice = rng.random()
    if choice < 0.3:
        sampling.update(temperature=0)
    elif choice < 0.6:
        sampling.update(temperature=rng.uniform(0.3, 1.5), top_p=rng.uniform(0.5, 1.0),
                        seed=rng.randrange(2**31))
    elif choice < 0.75 and protocol in ("grpc", "http"):
        sampling.update(n=2, temperature=1.0)
    elif choice < 0.9:
        sampling.update(stop=[rng.choice(WORDS)])
    elif protocol in ("grpc", "http"):
        sampling.update(logprobs=rng.randint(0, 5))
    bad = rng.random() < 0.05 and protocol != "tgi"
    if bad:
        sampling.update(rng.choice(BAD_SAMPLING))
    cut_after = rng.randint(1, 4) if not bad and rng.random() < 0.1 else None
    return protocol, prompt, sampling, cut_after, bad


async def soak(client: Client, probe: MetricsProbe, pids: list[int], seconds: float,
               protocols: list[str], concurrency: int, max_tokens: int, rng: random.Random,
               sample_every: float = 5.0) -> dict:
    idle_before = await warmed_idle_usage(client, probe, pids, protocols, concurrency)
    end = time.perf_counter() + seconds
    counts = {"good": 0, "bad": 0, "cut": 0}
    failures: list[str] = []
    unrejected: list[dict] = []
    samples: list[tuple[float, int]] = []

    async def worker():
        while time.perf_counter() < end:
            protocol, prompt, sampling, cut_after, bad = mixed_request(rng, protocols, max_tokens)
            outcome = await client.stream(protocol, prompt, sampling, cut_after)
            if bad:
                counts["bad"] += 1
                if outcome.error is None:
                    unrejected.append(sampling)
            elif outcome.cut:
                counts["cut"] += 1
            else:
                counts["good"] += 1
                if outcome.error is not None:
                    failures.append(f"{protocol}: {outcome.error}")

    async def sampler():
        start = time.perf_counter()
        while time.perf_counter() < end:
            samples.append((time.perf_counter() - start, usage(pids).rss_bytes))
            await asyncio.sleep(sample_every)

    await asyncio.gather(sampler(), gather_limited([worker() for _ in range(concurrency)],
                                                   concurrency))
    gauges = probe.wait_idle()
    idle_after = await settled_usage(pids)
    warm = [rss for at, rss in samples if at >= WARM_UP_SHARE * seconds] or [samples[-1][1]]
    drift = (warm[-1] - warm[0]) / warm[0]
    return {"scenario": "soak", "seconds": seconds, "protocols": protocols, **counts,
            "failures": failures[:5], "failure_count": len(failures),
            "bad_requests_accepted": unrejected[:5], "idle_gauges": gauges,
            "rss_mib": [round(rss / 2**20, 1) for _, rss in samples],
            "rss_drift_after_warm_up": round(drift, 4),
            "idle_before": idle_before.as_dict(), "idle_after": idle_after.as_dict(),
            "ok": not failures and not unrejected and drift < MAX_RSS_DRIFT
            and not any(gauges.values()) and not grew(idle_before, idle_after)}
