"""tritonlm-stress: the long reliability runs (issue 28) against a real tritonserver and front end
started on a model's weights with the scenario's engine settings. Prints a JSON report; exits 1
when what the scenario proves did not hold.

  tritonlm-stress kv-pressure --streams 512 --kv-sequences 16
  tritonlm-stress cut-streams --streams 1000 --protocol grpc http openai tgi
  tritonlm-stress overload --capacity 16 --multiple 3 --seconds 60
  tritonlm-stress soak --seconds 1800
  tritonlm-stress replicas --concurrency 8   (stress/replicas.py: two replicas behind the front end)
"""
import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tritonlm.config import WEIGHTS_DIR, linked_repository
from tritonlm.ports import free_ports
from tritonlm.stress.clients import PROTOCOLS, Client, Endpoints
from tritonlm.stress.probes import MetricsProbe
from tritonlm.stress.replicas import replicas
from tritonlm.stress.scenarios import cut_streams, kv_pressure, overload
from tritonlm.stress.soak import soak

SCENARIOS = ("kv-pressure", "cut-streams", "overload", "soak", "replicas")
BLOCK_SIZE = 16
PROMPT_TOKENS = (16, 64)


def engine_settings(args) -> dict:
    if args.scenario == "kv-pressure":
        blocks = math.ceil((PROMPT_TOKENS[1] + args.output_len) / BLOCK_SIZE)
        # Requests start whenever their prompts fit (no headroom kept for output), so that the
        # running ones preempt each other: the scenario is there to exercise preemption.
        return {"block_size": BLOCK_SIZE, "num_kv_blocks": args.kv_sequences * blocks,
                "max_concurrent_requests": max(128, args.streams), "admission_headroom_blocks": 0}
    if args.scenario == "overload":
        return {"max_concurrent_requests": args.capacity}
    return {}


@dataclass
class Served:
    endpoints: Endpoints
    pids: list[int]  # the server's and the front end's
    metrics: str  # host:port
    exit_code: int | None = None  # tritonserver's, once stopped: not 0 when its stop hung


@contextmanager
def served(model_dir: Path, settings: dict, log_path: Path):
    """A Served while tritonserver and the front end run."""
    from tritonlm.frontend_process import FrontendProcess
    from tritonlm.serve import TritonServerProcess
    with tempfile.TemporaryDirectory(prefix="tritonlm-stress-") as scratch, \
            open(log_path, "w") as log:
        repo = linked_repository(model_dir, Path(scratch), **settings)
        http, grpc, metrics, frontend_port = free_ports(4)
        server = TritonServerProcess(repo, http, grpc, metrics, stdout=log,
                                     stderr=subprocess.STDOUT).start()
        frontend = None
        try:
            if not server.wait_ready(timeout=600):
                raise SystemExit(f"tritonserver exited before it was ready; see {log_path}")
            frontend = FrontendProcess(repo, frontend_port, grpc, metrics, stdout=log,
                                       stderr=subprocess.STDOUT).start()
            if not frontend.wait_ready():
                raise SystemExit(f"the HTTP front end did not become ready; see {log_path}")
            running = Served(Endpoints(f"127.0.0.1:{grpc}", f"127.0.0.1:{http}",
                                       f"http://127.0.0.1:{frontend_port}"),
                             [server.proc.pid, frontend.proc.pid], f"127.0.0.1:{metrics}")
            yield running
        finally:
            if frontend is not None:
                frontend.stop()
            exit_code = server.stop()
        running.exit_code = exit_code


def token_prompts(model_dir: Path, count: int, rng: random.Random) -> list[list[int]]:
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model_dir / "1" / WEIGHTS_DIR).vocab_size
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(*PROMPT_TOKENS))]
            for _ in range(count)]


async def run(args, endpoints: Endpoints, pids: list[int], metrics: str) -> dict:
    rng = random.Random(args.seed)
    client = Client(endpoints)
    probe = MetricsProbe(metrics, endpoints.model)
    try:
        if args.scenario == "kv-pressure":
            prompts = token_prompts(args.model, args.streams, rng)
            return await kv_pressure(client, probe, prompts, args.output_len)
        if args.scenario == "cut-streams":
            return await cut_streams(client, probe, pids, args.streams, args.protocol,
                                     args.output_len, args.concurrency, rng)
        if args.scenario == "overload":
            return await overload(client, probe, pids, args.capacity, args.seconds,
                                  args.multiple, args.output_len, rng)
        return await soak(client, probe, pids, args.seconds, args.protocol, args.concurrency,
                          args.output_len, rng)
    finally:
        await client.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tritonlm-stress", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[3:]))
    p.add_argument("scenario", choices=SCENARIOS)
    p.add_argument("--model", type=Path, help="converted model dir REPO/NAME (default: SmolLM2)")
    p.add_argument("--streams", type=int, help="kv-pressure (512), cut-streams (1000)")
    p.add_argument("--kv-sequences", type=int, default=16,
                   help="kv-pressure: the KV cache holds this many whole sequences")
    p.add_argument("--output-len", type=int, default=32, help="tokens per request (soak: most)")
    p.add_argument("--concurrency", type=int, default=32, help="cut-streams, soak, replicas")
    p.add_argument("--protocol", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    p.add_argument("--seconds", type=float, help="overload (60), soak (1800)")
    p.add_argument("--capacity", type=int, default=16,
                   help="overload: max_concurrent_requests of the served engine")
    p.add_argument("--multiple", type=float, default=3.0, help="overload: offered load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the report here")
    return p


# tritonserver's line when its stop gave up waiting for a model to unload.
EXIT_TIMEOUT = "Exit timeout expired"


def cancels_grpc_streams(args) -> bool:
    """Whether the scenario's clients cancel gRPC streams. Then tritonserver 2.51 sometimes never
    unloads the model (the stub idle, its finalize never called; cut-streams' stop once in five
    `make test` runs under two workers), a hang of Triton's unload path also reported upstream
    (triton-inference-server/server#8755): its stop waits out the exit timeout, after which
    tritonlm-serve ends the stub. Reported (server_stop_timed_out), not failed."""
    return args.scenario in ("cut-streams", "soak") and "grpc" in args.protocol


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    defaults = {"kv-pressure": (512, None), "cut-streams": (1000, None),
                "overload": (None, 60.0), "soak": (None, 1800.0), "replicas": (None, None)}[args.scenario]
    args.streams = args.streams or defaults[0]
    args.seconds = args.seconds or defaults[1]
    if args.model is None:
        from tritonlm.bench.cli import default_model_dir
        args.model = default_model_dir("float32")
    log_path = (args.json or Path(f"tritonlm-stress-{args.scenario}")).with_suffix(".server.log")
    if args.scenario == "replicas":
        report = replicas(args.model, log_path, args.concurrency, args.output_len, args.seed)
    else:
        with served(args.model, engine_settings(args), log_path) as running:
            report = asyncio.run(run(args, running.endpoints, running.pids, running.metrics))
        # Every request has ended: the server stops at once, not after its exit timeout, except
        # where Triton's own unload can hang (cancels_grpc_streams).
        report["server_exit_code"] = running.exit_code
        report["server_stop_timed_out"] = EXIT_TIMEOUT in log_path.read_text(errors="replace")
        report["ok"] = report["ok"] and (running.exit_code == 0 or (
            report["server_stop_timed_out"] and cancels_grpc_streams(args)))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    if not report["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
