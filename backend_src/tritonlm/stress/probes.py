"""What a stress run watches on the server: the engine's Prometheus gauges and counters, and the
threads, file descriptors and resident memory of the server's processes (tritonserver, its
Python-backend stubs and tensor-parallel ranks, the front end), read from /proc."""
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

POOL_SLACK = 4
IDLE_GAUGES = ("tritonlm:num_requests_running", "tritonlm:num_requests_waiting",
               "tritonlm:kv_cache_blocks_used")


@dataclass(frozen=True)
class ProcessUsage:
    processes: int
    threads: int
    fds: int
    rss_bytes: int
    per_process: dict  # "name pid" -> (threads, fds, RSS MiB)

    def as_dict(self) -> dict:
        return {"processes": self.processes, "threads": self.threads, "fds": self.fds,
                "rss_mib": round(self.rss_bytes / 2**20, 1),
                "threads_fds_rss_per_process": self.per_process}


def grew(before: ProcessUsage, after: ProcessUsage) -> bool:
    """Whether threads, fds or processes grew past what on-demand pools explain (tritonserver's
    gRPC and HTTP workers add a few under load and keep them): a leak grows with the requests,
    hundreds in a run."""
    return (after.processes != before.processes or after.threads > before.threads + POOL_SLACK
            or after.fds > before.fds + POOL_SLACK)


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return []


def process_tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        todo.extend(_children(current))
    return pids


def _usage_of(pid: int) -> tuple[str, int, int, int]:
    base = Path(f"/proc/{pid}")
    try:
        status = dict(line.split(":", 1) for line in (base / "status").read_text().splitlines()
                      if ":" in line)
        threads = int(status["Threads"])
        rss = int(status.get("VmRSS", "0 kB").split()[0]) * 1024
        return status["Name"].strip(), threads, len(os.listdir(base / "fd")), rss
    except (OSError, KeyError, ValueError):
        return "", 0, 0, 0  # the process ended meanwhile


def usage(root_pids: list[int]) -> ProcessUsage:
    """Totals over the process trees under `root_pids`."""
    pids = sorted({p for root in root_pids for p in process_tree(root)})
    parts = {pid: _usage_of(pid) for pid in pids}
    return ProcessUsage(len(pids), sum(p[1] for p in parts.values()),
                        sum(p[2] for p in parts.values()), sum(p[3] for p in parts.values()),
                        {f"{p[0]} {pid}": (p[1], p[2], round(p[3] / 2**20, 1))
                         for pid, p in parts.items()})


class MetricsProbe:
    """The `tritonlm:` samples on tritonserver's metrics endpoint (host:port)."""

    def __init__(self, metrics_url: str, model: str):
        self.url = f"http://{metrics_url}/metrics"
        self.model = model

    def samples(self) -> dict[str, float]:
        """Each tritonlm sample of the model, by name and sorted labels other than model/version."""
        with urllib.request.urlopen(self.url, timeout=10) as response:
            text = response.read().decode()
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.startswith("tritonlm:"):
                    continue
                labels = {k: v for k, v in sample.labels.items() if k not in ("model", "version")}
                if sample.labels.get("model", self.model) != self.model:
                    continue
                key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
                values[key] = sample.value
        return values

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """The gauges once running, waiting and KV blocks in use are all 0 (or at the timeout:
        then the caller sees which one is not)."""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.samples()
            if all(samples.get(g, 0) == 0 for g in IDLE_GAUGES) or time.monotonic() > deadline:
                return {g: samples.get(g, 0) for g in IDLE_GAUGES}
            time.sleep(0.5)
