"""tritonlm-stress's scenarios, scaled to CI, on a tiny model served by the real tritonserver and
front end (the full-size runs and their figures: README, "Reliability")."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from family_check import tiny_llama
from tritonlm.stress.probes import POOL_SLACK
from tritonlm.stress.soak import MAX_RSS_DRIFT

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_tokenizer) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("stress"), smollm2_tokenizer)[1]


def stress(tiny_model: Path, tmp_path: Path, *args: str, cancels: bool = False) -> dict:
    out = tmp_path / "report.json"
    command = [str(Path(sys.executable).parent / "tritonlm-stress"), *args,
               "--model", str(tiny_model), "--json", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert out.exists(), run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert run.returncode == (0 if report["ok"] else 1)
    # Stopped at once, its requests all ended; or, where clients cancelled gRPC streams, after
    # tritonserver 2.51's unload hang (stress/cli.py cancels_grpc_streams), not after a crash.
    assert report["server_exit_code"] == 0 or (cancels and report["server_stop_timed_out"]), report
    return report


def test_streams_beyond_the_kv_cache_all_finish_with_their_greedy_tokens(tiny_model, tmp_path):
    report = stress(tiny_model, tmp_path, "kv-pressure", "--streams", "24", "--kv-sequences", "4",
                    "--output-len", "24")
    assert report["error_count"] == 0 and report["short"] == 0
    assert report["mismatches"] == 0
    assert report["preemptions"] > 0
    assert not any(report["idle_gauges"].values())


def test_cut_streams_leave_no_blocks_threads_or_fds_behind(tiny_model, tmp_path):
    report = stress(tiny_model, tmp_path, "cut-streams", "--streams", "64", "--concurrency", "16",
                    "--output-len", "24", cancels=True)
    assert report["cut"] == 64 and report["error_count"] == 0
    assert not any(report["idle_gauges"].values())
    before, after = report["idle_before"], report["idle_after"]
    assert after["processes"] == before["processes"]
    assert after["threads"] <= before["threads"] + POOL_SLACK  # 64 leaked would show
    assert after["fds"] <= before["fds"] + POOL_SLACK


def test_overload_is_refused_fast_while_accepted_requests_keep_their_latency(tiny_model,
                                                                             tmp_path):
    report = stress(tiny_model, tmp_path, "overload", "--capacity", "4", "--seconds", "10",
                    "--output-len", "16")
    assert report["refused"] > 0 and report["accepted_latency"]["count"] > 0
    assert report["other_error_count"] == 0
    assert report["refusal_latency"]["p99"] < 1.0
    assert report["ok"], report


def test_mixed_traffic_soak(tiny_model, tmp_path):
    report = stress(tiny_model, tmp_path, "soak", "--seconds", "30", "--concurrency", "8",
                    "--output-len", "24", cancels=True)
    assert report["good"] > 0 and report["bad"] > 0 and report["cut"] > 0
    assert report["failure_count"] == 0 and not report["bad_requests_accepted"]
    assert not any(report["idle_gauges"].values()), report["idle_gauges"]
    before, after = report["idle_before"], report["idle_after"]
    assert after["processes"] == before["processes"], (before, after)
    assert after["threads"] <= before["threads"] + POOL_SLACK, (before, after)
    assert after["fds"] <= before["fds"] + POOL_SLACK, (before, after)
    assert report["rss_drift_after_warm_up"] < MAX_RSS_DRIFT, report["rss_mib"]
    assert report["ok"]
