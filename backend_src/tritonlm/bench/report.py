"""The benchmark's output: a table on stdout, the full figures as JSON, latency against
throughput as a PNG."""
import json
import math
import os
import statistics
from pathlib import Path


def _ms(stats: dict, key: str = "p50") -> str:
    value = stats.get(key, math.nan) if stats else math.nan
    return "-" if math.isnan(value) else f"{value:.1f}"


def print_table(title: str, runs: list[dict]) -> None:
    print(title)
    print(f"  {'system':34s} {'out tok/s':>10s} {'req/s':>7s} {'TTFT p50/p99 ms':>17s} "
          f"{'TPOT p50 ms':>11s} {'ITL p99 ms':>10s} {'e2e p50 ms':>10s} {'goodput':>8s}")
    for run in runs:
        goodput = run.get("goodput", {}).get("requests_per_s")
        print(f"  {run['system']:34s} {run['output_tokens_per_s']:10.1f} "
              f"{run['requests_per_s']:7.2f} "
              f"{_ms(run['ttft_ms']) + '/' + _ms(run['ttft_ms'], 'p99'):>17s} "
              f"{_ms(run['tpot_ms']):>11s} {_ms(run['itl_ms'], 'p99'):>10s} "
              f"{_ms(run['e2e_ms']):>10s} {'-' if goodput is None else f'{goodput:.2f}':>8s}")
        if run.get("failed"):
            print(f"    {run['failed']} requests failed: {run.get('errors')}")


def ratios(runs: list[dict], ours: str) -> dict[str, list[float]]:
    """Our output tokens/s over every other system's, round by round: runs of one round are
    minutes apart, so a round's ratio sees less of the machine's drift than medians would."""
    by_system = {run["system"]: run["rounds_output_tokens_per_s"] for run in runs}
    if ours not in by_system:
        return {}
    return {name: [a / b for a, b in zip(by_system[ours], rounds)]
            for name, rounds in by_system.items() if name != ours and min(rounds) > 0}


def versus_grpc(runs: list[dict]) -> dict[str, dict]:
    """Every served run over another protocol against the gRPC run of the same load (stream
    interval, concurrency or rate): its output tokens/s over gRPC's and its median TTFT minus
    gRPC's, round by round, and the median round of each."""
    def load(run: dict) -> tuple:
        return run["stream_interval"], run.get("concurrency"), run.get("request_rate")
    grpc = {load(run): run for run in runs if run.get("protocol") == "grpc"}
    versus = {}
    for run in runs:
        base = grpc.get(load(run)) if run.get("protocol") not in (None, "grpc") else None
        if base is None:
            continue
        # rounds where both runs streamed tokens (a run whose requests all failed has none)
        rounds = [(a, b, c, d) for a, b, c, d in zip(
            run["rounds_output_tokens_per_s"], base["rounds_output_tokens_per_s"],
            run["rounds_ttft_p50_ms"], base["rounds_ttft_p50_ms"]) if a > 0 and b > 0]
        ratios = [a / b for a, b, _, _ in rounds]
        ttft = [c - d for _, _, c, d in rounds]
        versus[run["system"]] = {
            "protocol": run["protocol"], "grpc_system": base["system"],
            "stream_interval": run["stream_interval"],
            "ratio": statistics.median_low(ratios) if rounds else math.nan,
            "ratio_rounds": ratios,
            "ttft_p50_diff_ms": statistics.median_low(ttft) if rounds else math.nan,
            "ttft_p50_diff_ms_rounds": ttft}
    return versus


def print_versus_grpc(versus: dict[str, dict]) -> None:
    for name, v in versus.items():
        load = name.rsplit(" ", 1)[-1] + (f", {v['stream_interval']} tokens per response"
                                          if v["stream_interval"] > 1 else "")
        rounds = v["ratio_rounds"]
        if not rounds:
            print(f"  {v['protocol']} / grpc at {load}: no round where both streamed tokens")
            continue
        spread = (f" (median of {len(rounds)} rounds: {min(rounds):.2f}x..{max(rounds):.2f}x)"
                  if len(rounds) > 1 else "")
        ttft = v["ttft_p50_diff_ms_rounds"]
        ttft_spread = (f" (rounds: {min(ttft):+.1f}..{max(ttft):+.1f} ms)"
                       if len(ttft) > 1 else "")
        print(f"  {v['protocol']} / grpc at {load}: {v['ratio']:.2f}x output tokens/s{spread}; "
              f"median TTFT {v['ttft_p50_diff_ms']:+.1f} ms{ttft_spread}")


def print_cpu_shares(runs: list[dict]) -> None:
    """The cores each part of a served system used in its median round (bench/cpu_shares.py)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for run in runs:
        if run.get("cpu_cores"):
            parts = ", ".join(f"{part} {used:.2f}" for part, used in run["cpu_cores"].items())
            waiting = run.get("engine_waiting")
            waited = "" if waiting is None else f"; engine threads waiting for a core {waiting:.2f}"
            print(f"  cores used in {run['system']}: {parts} (of {cores}){waited}")


def speculation(runs: list[dict], suffix: str) -> dict[str, dict]:
    """Each run of a speculative series (its name ends in `suffix`) against the run without it at
    the same concurrency: TPOT (p50) without over with, and output tokens/s with over without,
    round by round (rounds where both produced tokens), and the median round of each."""
    plain = {(run["series"], run.get("concurrency")): run for run in runs if "series" in run}
    versus = {}
    for run in runs:
        series = run.get("series", "")
        base = plain.get((series.removesuffix(suffix), run.get("concurrency")))
        if not suffix or not series.endswith(suffix) or base is None:
            continue
        rounds = [r for r in zip(run["rounds_tpot_p50_ms"], base["rounds_tpot_p50_ms"],
                                 run["rounds_output_tokens_per_s"],
                                 base["rounds_output_tokens_per_s"]) if min(r) > 0]
        if not rounds:
            continue
        tpot = [b / a for a, b, _, _ in rounds]
        speed = [c / d for _, _, c, d in rounds]
        versus[run["system"]] = {"base": base["system"], "tpot_lower": tpot,
                                 "tokens_per_s_higher": speed,
                                 "tpot_lower_median": statistics.median_low(tpot),
                                 "tokens_per_s_higher_median": statistics.median_low(speed)}
    return versus


def print_speculation(versus: dict[str, dict]) -> None:
    for name, v in versus.items():
        tpot, speed = v["tpot_lower"], v["tokens_per_s_higher"]
        print(f"  {name} vs {v['base']}: TPOT {v['tpot_lower_median']:.2f}x lower (rounds "
              f"{min(tpot):.2f}x..{max(tpot):.2f}x), output tokens/s "
              f"{v['tokens_per_s_higher_median']:.2f}x "
              f"(rounds {min(speed):.2f}x..{max(speed):.2f}x)")


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, allow_nan=True))


def plot(path: Path, runs: list[dict]) -> None:
    """Median TTFT and TPOT against output tokens/s; the points of one system form a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    series: dict[str, list[dict]] = {}
    for run in runs:
        if not math.isnan(run["ttft_ms"]["p50"]):
            series.setdefault(run.get("series", run["system"]), []).append(run)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, key, label in ((axes[0], "ttft_ms", "TTFT p50 (ms)"),
                             (axes[1], "tpot_ms", "TPOT p50 (ms)")):
        for system, points in series.items():
            points = sorted(points, key=lambda r: r["output_tokens_per_s"])
            axis.plot([p["output_tokens_per_s"] for p in points],
                      [p[key]["p50"] for p in points], marker="o", label=system)
        axis.set_xlabel("output tokens/s")
        axis.set_ylabel(label)
        axis.set_yscale("log")
        axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
