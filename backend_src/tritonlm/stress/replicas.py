"""`tritonlm-stress replicas`: two single-thread tritonservers (OMP_NUM_THREADS=1 each) on
loopback behind the front end's replica routing (issue 30), on one shared-prefix workload: GROUPS
system prompts, each followed by QUESTIONS different questions, sent in random order at a fixed
concurrency through the OpenAI route. Each run gets its own system prompts, so every run starts
with cold prefix caches.

1. one replica: throughput;
2. two replicas, round-robin: throughput and the prefix-cache hit rate;
3. two replicas, prefix affinity (the default): the same;
4. two replicas, prefix affinity, one SIGKILLed after a third of the requests ended: every request
   that had not started by then must complete on the other.
"""
import asyncio
import os
import random
import signal
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from tritonlm.config import linked_repository
from tritonlm.frontend_process import FrontendProcess
from tritonlm.ports import free_ports
from tritonlm.serve import TritonServerProcess
from tritonlm.stress.clients import Client, Endpoints
from tritonlm.stress.probes import MetricsProbe

GROUPS, QUESTIONS = 8, 6
WORDS = ("ship", "harbour", "cargo", "crane", "tide", "ledger", "rope", "anchor", "berth", "manifest",
         "customs", "freight", "pallet", "route", "storm", "pilot", "dock", "hull", "keel", "sail")


def workload(rng: random.Random) -> list[str]:
    """GROUPS x QUESTIONS prompts in random order; each group's shares a ~200-token system prompt."""
    prompts = []
    for group in range(GROUPS):
        system = f"System {group}: " + " ".join(rng.choice(WORDS) for _ in range(150)) + ".\n"
        prompts += [system + f"Question {q}: what about the {rng.choice(WORDS)}?" for q in range(QUESTIONS)]
    rng.shuffle(prompts)
    return prompts


def hit_rate(probes: list[MetricsProbe], before: list[dict]) -> float:
    hits = queries = 0.0
    for probe, start in zip(probes, before):
        now = probe.samples()
        hits += now.get("tritonlm:prefix_cache_hits_total", 0) - start.get("tritonlm:prefix_cache_hits_total", 0)
        queries += now.get("tritonlm:prefix_cache_queries_total", 0) - start.get("tritonlm:prefix_cache_queries_total", 0)
    return hits / queries if queries else 0.0


async def drive(frontend: str, prompts: list[str], concurrency: int, output_len: int,
                on_done=None) -> tuple[list, float]:
    """Every prompt streamed once (greedy, `output_len` tokens); (outcomes with start flags, seconds)."""
    client = Client(Endpoints("", "", frontend))
    queue, results = list(enumerate(prompts)), [None] * len(prompts)
    start = time.perf_counter()

    async def worker():
        while queue:
            index, prompt = queue.pop(0)
            results[index] = await client.stream("openai", prompt, {"max_tokens": output_len, "temperature": 0,
                                                                    "ignore_eos": True})
            if on_done is not None:
                on_done(results, queue)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return results, time.perf_counter() - start


def _throughput(outcomes: list, seconds: float, output_len: int) -> dict:
    good = sum(o.error is None for o in outcomes)
    return {"requests": len(outcomes), "failed": len(outcomes) - good, "seconds": round(seconds, 2),
            "requests_per_s": round(good / seconds, 3), "output_tokens_per_s": round(good * output_len / seconds, 1)}


async def runs(frontends: dict[str, str], probes: list[MetricsProbe], servers: list, rng: random.Random,
               concurrency: int, output_len: int) -> dict:
    report = {}
    for name in ("one replica", "round-robin", "prefix-affinity"):
        before = [p.samples() for p in probes]
        outcomes, seconds = await drive(frontends[name], workload(rng), concurrency, output_len)
        report[name] = {**_throughput(outcomes, seconds, output_len), "prefix_cache_hit_rate":
                        round(hit_rate(probes if name != "one replica" else probes[:1], before), 3)}
    prompts = workload(rng)
    not_started: set[int] = set()
    killed = False

    def kill_after_a_third(results, queue):
        nonlocal killed
        if not killed and sum(r is not None for r in results) >= len(prompts) // 3:
            os.killpg(servers[1].proc.pid, signal.SIGKILL)
            killed = True
            not_started.update(index for index, _ in queue)  # the rest are in flight or done

    outcomes, seconds = await drive(frontends["prefix-affinity"], prompts, concurrency, output_len,
                                    kill_after_a_third)
    queued = [outcomes[index] for index in sorted(not_started)]
    report["replica killed"] = {**_throughput(outcomes, seconds, output_len),
                                "not_started_at_kill": len(queued),
                                "not_started_failed": sum(o.error is not None for o in queued)}
    report["ok"] = (all(report[n]["failed"] == 0 for n in ("one replica", "round-robin", "prefix-affinity"))
                    and report["replica killed"]["not_started_failed"] == 0)
    return report


def replicas(model_dir: Path, log_path: Path, concurrency: int, output_len: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tritonlm-replicas-") as scratch, open(log_path, "w") as log, \
            ExitStack() as stack:
        repo = linked_repository(model_dir, Path(scratch))
        servers, ports = [], []
        for _ in range(2):
            http, grpc, metrics = free_ports(3)
            server = TritonServerProcess(repo, http, grpc, metrics, stdout=log, stderr=subprocess.STDOUT)
            server.env = {**server.env, "OMP_NUM_THREADS": "1"}
            servers.append(server.start())
            stack.callback(server.stop)
            ports.append((grpc, metrics))
        if not all(server.wait_ready(timeout=600) for server in servers):
            raise SystemExit(f"a tritonserver exited before it was ready; see {log_path}")
        frontends = {}
        for name, grpc_ports, routing in (("one replica", ports[0][0], None),
                                          ("round-robin", [p[0] for p in ports], "round-robin"),
                                          ("prefix-affinity", [p[0] for p in ports], "prefix-affinity")):
            port = free_ports(1)[0]
            frontend = FrontendProcess(repo, port, grpc_ports, ports[0][1], stdout=log, stderr=subprocess.STDOUT,
                                       routing=routing).start()
            stack.callback(frontend.stop)
            if not frontend.wait_ready():
                raise SystemExit(f"the HTTP front end did not become ready; see {log_path}")
            frontends[name] = f"http://127.0.0.1:{port}"
        probes = [MetricsProbe(f"127.0.0.1:{metrics}", "llm") for _, metrics in ports]
        return asyncio.run(runs(frontends, probes, servers, random.Random(seed), concurrency, output_len))
