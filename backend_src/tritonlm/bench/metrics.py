"""Per-request timings and the figures serving benchmarks report from them (vLLM's definitions):
TTFT = first token - send; ITL = gaps between token arrivals; TPOT = (e2e - TTFT) / (tokens - 1)."""
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    prompt_len: int
    sent: float  # perf_counter seconds
    token_times: list[float] = field(default_factory=list)  # one entry per generated token
    error: str | None = None

    def add_tokens(self, count: int, at: float) -> None:
        """`count` tokens arrived together (a streamed delta) at `at`."""
        self.token_times.extend([at] * count)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.sent

    @property
    def tpot(self) -> float:
        n = len(self.token_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else math.nan

    @property
    def itls(self) -> np.ndarray:
        return np.diff(np.asarray(self.token_times))


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float

    @classmethod
    def parse(cls, text: str) -> "Slo":
        """"ttft_ms,tpot_ms", e.g. "500,50"."""
        try:
            ttft, tpot = (float(v) for v in text.split(","))
        except ValueError:
            raise ValueError(f"--slo takes ttft_ms,tpot_ms (e.g. 500,50), not {text!r}") from None
        return cls(ttft, tpot)

    def met(self, record: RequestRecord) -> bool:
        tpot = record.tpot
        return (record.ttft * 1e3 <= self.ttft_ms
                and (math.isnan(tpot) or tpot * 1e3 <= self.tpot_ms))


def _stats_ms(values) -> dict[str, float]:
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    return {"mean": float(values.mean() * 1e3), "p50": float(np.percentile(values, 50) * 1e3),
            "p99": float(np.percentile(values, 99) * 1e3)}


def summarize(records: list[RequestRecord], duration: float, slo: Slo | None = None) -> dict:
    """Figures over one run of `duration` seconds (first send to last token)."""
    done = [r for r in records if r.ok]
    output_tokens = sum(len(r.token_times) for r in done)
    summary = {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "input_tokens": sum(r.prompt_len for r in done),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration,
        "requests_per_s": len(done) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in done]),
        "tpot_ms": _stats_ms([r.tpot for r in done]),
        "itl_ms": _stats_ms(np.concatenate([r.itls for r in done]) if done else []),
        "e2e_ms": _stats_ms([r.e2e for r in done]),
    }
    if slo is not None:
        good = sum(slo.met(r) for r in done)
        summary["goodput"] = {"slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
                              "requests_per_s": good / duration,
                              "fraction": good / len(records) if records else math.nan}
    errors = sorted({r.error for r in records if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary
