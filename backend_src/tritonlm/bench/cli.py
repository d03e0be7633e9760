"""tritonlm-bench: throughput and latency of tritonlm offline (the engine in process) and served
(a real tritonserver over gRPC streaming or HTTP SSE, or the OpenAI / TGI front end beside it),
next to HF transformers and vLLM on the same requests.

  tritonlm-bench --mode offline serve --concurrency 32 --compare hf vllm --rounds 3 --json out.json
  tritonlm-bench --mode serve --protocol grpc openai tgi --concurrency 32 --rounds 3
  tritonlm-bench --workload grounded --speculative ngram --offline-concurrency 1 --num-requests 8
"""
import argparse
import statistics
from contextlib import ExitStack
from pathlib import Path

from tritonlm.bench import chat_workloads, metrics, report, workloads
from tritonlm.bench import systems
from tritonlm.config import DTYPES, WEIGHTS_DIR, EngineConfig
from tritonlm.engine.auto_dtype import resolve_dtype
from tritonlm.engine.llm_engine import resolve_model_dir
from tritonlm.engine.model_runner import resolve_device
from tritonlm.models.loader import load_config
from tritonlm_convert.once import convert_once

_CACHE = Path.home() / ".cache" / "tritonlm" / "bench"


def default_model_dir(dtype: str) -> Path:
    """The embedded SmolLM2, converted once per dtype."""
    return convert_once(_CACHE / dtype, "default", "--dtype", dtype)


def _int_pair(text: str) -> tuple[int, int]:
    low, high = (int(v) for v in text.split(","))
    return low, high


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tritonlm-bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[3:]))
    p.add_argument("--model", type=Path, help="converted model dir REPO/NAME (default: SmolLM2)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="dtype the default model is converted to (another model: its engine.json); "
                        "auto: the engine's choice for this machine")
    p.add_argument("--mode", nargs="+", choices=("offline", "serve"), default=["offline"])
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("fixed", "random", "shared-prefix", "sharegpt",
                                          "grounded", "chat"), default="fixed",
                   help="grounded: chat requests to edit or restate a given text or code; chat: "
                        "open questions (bench/chat_workloads.py)")
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
                   "--protocol http); default: start tritonserver (and the front end for openai "
                   "/ tgi) on --model's repository")
    s.add_argument("--frontend-url", help="http://host:port of a running HTTP front end "
                   "(tritonlm-frontend, port 8080 under tritonlm-serve), for --protocol openai / "
                   "tgi")
    s.add_argument("--served-model", default=None, help="model name on the server")
    s.add_argument("--protocol", nargs="+", choices=("grpc", "http", "openai", "tgi"),
                   default=["grpc"], help="grpc (ModelStreamInfer), http (generate_stream SSE), "
                   "openai (the front end's streamed /v1/completions), tgi (its /generate_stream, "
                   "text prompts); several compare them run by run, each against grpc")
    s.add_argument("--concurrency", type=lambda t: [int(v) for v in t.split(",")],
                   help="requests in flight, one run per value (e.g. 1,8,32)")
    s.add_argument("--request-rate", type=lambda t: [float(v) for v in t.split(",")],
                   help="Poisson arrivals per second, one run per value (inf: all at once)")
    s.add_argument("--stream-interval", type=lambda t: [_positive(v) for v in t.split(",")],
                   default=[1], help="tokens per streamed response after the first (the "
                   "stream_interval sampling key), one series per value (e.g. 1,4)")
    w.add_argument("--offline-concurrency", type=_positive, metavar="N",
                   help="offline: requests in the engine at once, the next added as one "
                        "finishes (default: all at once)")
    spec = p.add_argument_group("speculative decoding (offline)")
    spec.add_argument("--speculative", metavar="ngram|DRAFT_REPO",
                      help="also time the engine with this speculation (prompt lookup, or a "
                           "converted draft model REPO/NAME), beside the one without")
    spec.add_argument("--num-speculative-tokens", type=_positive, metavar="K",
                      help="default: the engine's for the proposer (ngram 8, a draft model 5)")
    lora = p.add_argument_group("LoRA adapters (offline)")
    lora.add_argument("--lora", type=_positive, metavar="N",
                      help="also run the engine serving N random adapters on every linear "
                           "layer, the requests spread over them, against the base model")
    lora.add_argument("--lora-rank", type=_positive, default=16, metavar="R")
    c = p.add_argument_group("comparison and output")
    c.add_argument("--compare", nargs="*", choices=("hf", "vllm"), default=[])
    c.add_argument("--compare-dtypes", nargs="+", choices=DTYPES, metavar="DTYPE",
                   help="run each compared system in each of these dtypes, to compare against "
                        "it at its best (default: the model's dtype; e.g. bfloat16 float32)")
    c.add_argument("--hf-requests", type=int, default=8,
                   help="requests HF runs one at a time (its tokens/s is measured on these)")
    c.add_argument("--rounds", type=_positive, default=1,
                   help="time every system this many times, alternating round by round; each "
                        "figure is the system's median round and each ratio the median of the "
                        "rounds' ratios (a shared machine's speed can drift 10-25%% within "
                        "minutes, which one run of each cannot tell from a real difference)")
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
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model_dir) / WEIGHTS_DIR)
    if args.workload in ("grounded", "chat"):
        return chat_workloads.chat_requests(args.workload, tokenizer, n, args.output_len)
    if args.dataset is None:
        raise SystemExit("--workload sharegpt needs --dataset FILE")
    max_len = EngineConfig.load(resolve_model_dir(model_dir)).max_model_len
    return workloads.sharegpt(args.dataset, lambda t: tokenizer.encode(t, add_special_tokens=False),
                              n, max_len, seed)


def run_rounds(contenders: list[systems.System], rounds: int) -> dict[str, list[dict]]:
    """Every system's timed runs, alternating: round after round, each system once."""
    summaries = {system.name: [] for system in contenders}
    for _ in range(rounds):
        for system in contenders:
            summaries[system.name].append(system.run())
    return summaries


def median_runs(contenders: list[systems.System], summaries: dict[str, list[dict]]) -> list[dict]:
    """Each system's figures from its median round, with every round's output tokens/s beside."""
    runs = []
    for system in contenders:
        ordered = sorted(summaries[system.name], key=lambda s: s["output_tokens_per_s"])
        runs.append({**ordered[(len(ordered) - 1) // 2], **system.extra,
                     "rounds_output_tokens_per_s": [s["output_tokens_per_s"]
                                                    for s in summaries[system.name]],
                     "rounds_ttft_p50_ms": [s["ttft_ms"]["p50"] for s in summaries[system.name]],
                     "rounds_tpot_p50_ms": [s["tpot_ms"]["p50"] for s in summaries[system.name]]})
    return runs


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.protocol = list(dict.fromkeys(args.protocol))
    if args.compare_dtypes and not args.compare:
        parser.error("--compare-dtypes needs --compare hf and/or vllm")
    model_dir = args.model or default_model_dir(args.dtype)
    version_dir = resolve_model_dir(model_dir)
    config = EngineConfig.load(version_dir)
    config.dtype = resolve_dtype(config.dtype, resolve_device(config.device),
                                 load_config(version_dir / WEIGHTS_DIR))
    requests = build_workload(args, model_dir)
    vocab = _vocab_size(model_dir)
    prefix = {}
    with ExitStack() as stack:
        contenders = []
        for mode, open_systems in (("offline", systems.offline), ("serve", systems.served)):
            if mode in args.mode:
                contenders += stack.enter_context(open_systems(args, model_dir, requests, vocab))
                if "prefix_cache" in contenders[-1].extra:
                    prefix[mode] = contenders[-1].extra.pop("prefix_cache")
        for dtype in dict.fromkeys(args.compare_dtypes or [config.dtype]):
            # named by dtype where it differs from ours
            suffix = "" if dtype == config.dtype else f" ({dtype})"
            if "hf" in args.compare:
                contenders += stack.enter_context(
                    systems.hf(args, model_dir, requests, dtype, suffix))
            if "vllm" in args.compare:
                contenders += stack.enter_context(
                    systems.vllm(model_dir, requests, config, dtype, suffix))
        summaries = run_rounds(contenders, args.rounds)
    runs = median_runs(contenders, summaries)  # after the systems stop: vLLM's settings come last

    lengths = sorted({(len(r.prompt_token_ids), r.output_len) for r in requests})
    title = (f"{len(requests)} requests, workload {args.workload} (in/out {lengths[0]}.."
             f"{lengths[-1]}), greedy, EOS ignored, {config.dtype}, model {model_dir}")
    report.print_table(title, runs)
    ours = runs[0]["system"]
    ratio_rounds = report.ratios(runs, ours)
    vs = {name: statistics.median_low(rounds) for name, rounds in ratio_rounds.items()}
    for name, rounds in ratio_rounds.items():
        spread = (f" (median of {len(rounds)} rounds: {min(rounds):.2f}x..{max(rounds):.2f}x)"
                  if len(rounds) > 1 else "")
        print(f"  {ours} / {name}: {vs[name]:.2f}x output tokens/s{spread}")
    versus_grpc = report.versus_grpc(runs)
    report.print_versus_grpc(versus_grpc)
    report.print_cpu_shares(runs)
    speculation = report.speculation(runs, systems.speculation_suffix(args.speculative))
    report.print_speculation(speculation)
    if args.lora:
        rates = {r.get("series"): r["output_tokens_per_s"] for r in runs}
        base, lora_rate = rates[systems.OURS], rates[systems.OURS + systems.lora_suffix(args)]
        print(f"  {args.lora} rank-{args.lora_rank} LoRA adapters: {lora_rate:.1f} output "
              f"tokens/s, {lora_rate / base:.0%} of the base model's {base:.1f}")
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
        from tritonlm.bench.roofline import workload_flops
        flops = workload_flops(roofline, runs[0])
        print(f"  matmul FLOPs: {flops['flops'] / 1e12:.2f} TFLOP in our run, "
              f"{flops['achieved_gflops']:.1f} GFLOP/s = {flops['fraction_of_peak']:.0%} of the "
              f"measured matmul peak ({roofline['matmul_peak_flops'] / 1e9:.1f} GFLOP/s)")
    if args.json:
        report.write_json(args.json, {"title": title, "dtype": config.dtype, "runs": runs,
                                      "ratios": vs, "ratio_rounds": ratio_rounds,
                                      "versus_grpc": versus_grpc, "speculation": speculation,
                                      "prefix_cache": prefix})
    if args.plot:
        report.plot(args.plot, runs)


if __name__ == "__main__":
    main()
