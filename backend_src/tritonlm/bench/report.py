"""The benchmark's output: a table on stdout, the full figures as JSON, latency against
throughput as a PNG."""
import json
import math
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
