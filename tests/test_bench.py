"""tritonlm-bench end to end: offline, served over gRPC and HTTP SSE against the real tritonserver,
next to transformers; the figures follow vLLM's benchmark definitions."""
import json
import math

import matplotlib.image
import pytest

from tritonlm.bench.cli import build_parser, build_workload, main
from tritonlm.bench.metrics import RequestRecord, Slo, summarize
from tritonlm.bench.serve_client import chunk_sizes
from tritonlm.bench.systems import server_urls

from conftest import SERVED_MAX_MODEL_LEN
from family_check import tiny_llama
from test_observability import delta, scrape


def test_latency_figures_follow_the_serving_benchmark_definitions():
    fast = RequestRecord(prompt_len=10, sent=0.0, token_times=[1.0, 1.5, 2.5])
    slow = RequestRecord(prompt_len=20, sent=1.0, token_times=[4.0, 4.2])
    failed = RequestRecord(prompt_len=5, sent=0.0, error="bad request")
    summary = summarize([fast, slow, failed], duration=4.0, slo=Slo.parse("1500,800"))
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["errors"] == ["bad request"]
    assert summary["input_tokens"] == 30 and summary["output_tokens"] == 5
    assert summary["output_tokens_per_s"] == pytest.approx(5 / 4.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx((1000 + 3000) / 2)
    assert summary["tpot_ms"]["p50"] == pytest.approx((750 + 200) / 2)  # (e2e - ttft) / (n - 1)
    assert summary["e2e_ms"]["mean"] == pytest.approx((2500 + 3200) / 2)
    assert sorted([500, 1000, 200]) == pytest.approx(sorted(
        [*fast.itls * 1e3, *slow.itls * 1e3]))
    assert summary["itl_ms"]["mean"] == pytest.approx((500 + 1000 + 200) / 3)
    # Only `fast` meets TTFT <= 1.5 s; a failed request counts against the fraction.
    assert summary["goodput"]["requests_per_s"] == pytest.approx(1 / 4.0)
    assert summary["goodput"]["fraction"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="ttft_ms,tpot_ms"):
        Slo.parse("fast")


def _runs(path) -> dict[str, dict]:
    return {run["system"]: run for run in json.loads(path.read_text())["runs"]}


def test_offline_with_transformers_shared_prefix_json_and_plot(smollm2_repo, tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    main(["--model", str(smollm2_repo), "--workload", "shared-prefix", "--num-requests", "4",
          "--prefix-len", "64", "--input-len", "8", "--output-len", "6", "--compare", "hf",
          "--hf-requests", "2", "--slo", "100000,100000", "--json", str(out), "--plot", str(png)])
    report = json.loads(out.read_text())
    runs = _runs(out)
    ours, hf = runs["tritonlm offline"], runs["hf generate, one at a time"]
    assert (ours["completed"], ours["output_tokens"], ours["input_tokens"]) == (4, 24, 4 * 72)
    assert (hf["completed"], hf["output_tokens"]) == (2, 12)
    assert ours["goodput"]["requests_per_s"] == pytest.approx(ours["requests_per_s"])
    for run in (ours, hf):
        assert 0 < run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]
        assert run["tpot_ms"]["mean"] > 0 and run["output_tokens_per_s"] > 0
    assert report["ratios"]["hf generate, one at a time"] == pytest.approx(
        ours["output_tokens_per_s"] / hf["output_tokens_per_s"])
    probe = report["prefix_cache"]["offline"]
    assert probe["ttft_cold_ms"] > probe["ttft_warm_ms"] > 0
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 100 and image.shape[1] > 100
    printed = capsys.readouterr().out
    assert "tritonlm offline / hf generate, one at a time" in printed
    assert "TTFT cold" in printed


def test_speculation_timed_beside_the_engine_without_it(smollm2_repo, tmp_path, capsys):
    """Grounded chat requests one at a time, with and without n-gram speculation: the same
    tokens, and TPOT and tokens/s compared round by round."""
    out = tmp_path / "spec.json"
    main(["--model", str(smollm2_repo), "--workload", "grounded", "--num-requests", "3",
          "--output-len", "24", "--offline-concurrency", "1", "--speculative", "ngram",
          "--num-speculative-tokens", "3", "--rounds", "2", "--json", str(out)])
    runs = _runs(out)
    plain, spec = runs["tritonlm offline c=1"], runs["tritonlm offline + ngram c=1"]
    assert plain["output_tokens"] == spec["output_tokens"] == 3 * 24
    # one at a time: each request's first token comes after the one before finished
    assert plain["e2e_ms"]["p50"] < plain["duration_s"] * 1e3 / 2
    versus = json.loads(out.read_text())["speculation"]["tritonlm offline + ngram c=1"]
    assert versus["base"] == "tritonlm offline c=1" and len(versus["tpot_lower"]) == 2
    assert versus["tpot_lower"] == pytest.approx([a / b for a, b in zip(
        plain["rounds_tpot_p50_ms"], spec["rounds_tpot_p50_ms"])])
    assert "tritonlm offline + ngram c=1 vs tritonlm offline c=1: TPOT" in capsys.readouterr().out


def test_compared_systems_run_in_each_asked_dtype(smollm2_repo, tmp_path, capsys):
    """Ours in the model's dtype (float32), transformers in it and in bfloat16: a run and a ratio
    each, named by dtype where it is not ours."""
    out = tmp_path / "dtypes.json"
    main(["--model", str(smollm2_repo), "--num-requests", "2", "--input-len", "8",
          "--output-len", "4", "--compare", "hf", "--compare-dtypes", "float32", "bfloat16",
          "--json", str(out)])
    runs = _runs(out)
    assert sorted(runs) == ["hf generate, one at a time", "hf generate, one at a time (bfloat16)",
                            "tritonlm offline"]
    assert all(run["completed"] == 2 and run["output_tokens"] == 8 for run in runs.values())
    ratios = json.loads(out.read_text())["ratios"]
    assert ratios["hf generate, one at a time (bfloat16)"] == pytest.approx(
        runs["tritonlm offline"]["output_tokens_per_s"]
        / runs["hf generate, one at a time (bfloat16)"]["output_tokens_per_s"])
    assert "tritonlm offline / hf generate, one at a time (bfloat16)" in capsys.readouterr().out


def test_served_over_grpc_at_several_concurrencies_and_stream_intervals(smollm2_server,
                                                                       smollm2_repo, tmp_path):
    out = tmp_path / "served.json"
    main(["--model", str(smollm2_repo), "--mode", "serve", "--url", smollm2_server.grpc_url,
          "--served-model", "llm", "--concurrency", "1,4", "--num-requests", "4",
          "--input-len", "16", "--output-len", "8", "--stream-interval", "1,4",
          "--json", str(out)])
    runs = _runs(out)
    assert sorted(runs) == ["tritonlm served (grpc) concurrency=1",
                            "tritonlm served (grpc) concurrency=4",
                            "tritonlm served (grpc, 4 tokens per response) concurrency=1",
                            "tritonlm served (grpc, 4 tokens per response) concurrency=4"]
    for name, run in runs.items():
        assert (run["completed"], run["failed"], run["output_tokens"]) == (4, 0, 32)
        # Token by token, inter-token gaps are real gaps; by 4 (1, 4, 3) most arrive together.
        assert (run["itl_ms"]["p50"] > 0) == (run["stream_interval"] == 1), name
    per_token = [runs[f"tritonlm served (grpc) concurrency={c}"] for c in (1, 4)]
    assert [run["concurrency"] for run in per_token] == [1, 4]


def test_a_served_runs_cores_are_told_by_part(smollm2_server):
    """Read from the real server's processes: the engine's threads are found by their name in
    Triton's stub (set on our threads, inherited by its OpenMP workers), the parts add up to
    no more than the machine, and the engine takes the most. Their wait for a core (the kernel's
    run-queue time) grows by far when busy processes run beside them (each in a session of its
    own: the kernel may share the CPU out by session first, and the server runs in its own)."""
    import asyncio
    import os
    import subprocess
    import sys

    import psutil
    from tritonlm.bench.cpu_shares import CpuShares
    from tritonlm.bench.serve_client import run_load
    from tritonlm.bench.workloads import fixed
    server = next(p for p in psutil.Process(smollm2_server.process.pid).children(recursive=True)
                  if p.name() == "tritonserver")
    shares = CpuShares(server.pid)

    def measure(batch):
        return shares.measure(lambda: asyncio.run(run_load(
            batch, smollm2_server.grpc_url, "llm", "grpc", 4, None, 0)))[1:]
    cores, waiting = measure(fixed(8, 16, 48, 49152, seed=11))
    assert list(cores) == ["tritonserver", "engine", "stub's other threads", "client"]
    assert cores["engine"] > 0.2 and cores["engine"] == max(cores.values()), cores
    assert all(used > 0 for used in cores.values()), cores
    machine = len(os.sched_getaffinity(0))
    assert sum(cores.values()) <= machine * 1.05, cores
    if waiting is None:
        pytest.skip("this kernel keeps no schedstat: no run-queue time to read")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(2 * machine)]
    try:
        _, waiting_beside_busy = measure(fixed(4, 16, 16, 49152, seed=12))
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert 0 <= waiting < waiting_beside_busy - 0.3, (waiting, waiting_beside_busy)


def test_served_through_the_front_end_against_grpc_run_by_run(smollm2_server, smollm2_repo,
                                                              tmp_path, capsys):
    """grpc, openai (/v1/completions) and tgi (/generate_stream) alternate round by round; each
    front-end run is reported against the gRPC run of the same load."""
    out = tmp_path / "front_end.json"
    main(["--model", str(smollm2_repo), "--mode", "serve", "--url", smollm2_server.grpc_url,
          "--frontend-url", smollm2_server.frontend_url, "--served-model", "llm",
          "--protocol", "grpc", "openai", "tgi", "--concurrency", "2", "--num-requests", "2",
          "--input-len", "16", "--output-len", "6", "--rounds", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    runs = _runs(out)
    names = [f"tritonlm served ({p}) concurrency=2" for p in ("grpc", "openai", "tgi")]
    assert sorted(runs) == sorted(names)
    for name, run in runs.items():
        assert (run["completed"], run["failed"], run["output_tokens"]) == (2, 0, 12), name
        assert run["itl_ms"]["p50"] > 0 and len(run["rounds_ttft_p50_ms"]) == 2
    assert runs[names[1]]["input_tokens"] == 32
    assert 28 <= runs[names[2]]["input_tokens"] <= 32  # TGI's text prompts, re-encoded
    grpc = runs[names[0]]
    for name in names[1:]:
        versus = report["versus_grpc"][name]
        assert versus["grpc_system"] == names[0]
        assert versus["ratio_rounds"] == pytest.approx(
            [a / b for a, b in zip(runs[name]["rounds_output_tokens_per_s"],
                                   grpc["rounds_output_tokens_per_s"])])
        assert versus["ratio"] == pytest.approx(min(versus["ratio_rounds"]))  # median_low of 2
        assert versus["ttft_p50_diff_ms_rounds"] == pytest.approx(
            [a - b for a, b in zip(runs[name]["rounds_ttft_p50_ms"], grpc["rounds_ttft_p50_ms"])])
    printed = capsys.readouterr().out
    assert "openai / grpc at concurrency=2:" in printed and "tgi / grpc at concurrency=2:" in printed
    assert "median TTFT" in printed


def test_front_end_runs_are_compared_with_grpc_only_in_rounds_where_both_streamed(capsys):
    from tritonlm.bench.report import print_versus_grpc, versus_grpc

    def run(protocol, tokens_per_s, ttft):
        return {"system": f"tritonlm served ({protocol}) concurrency=8", "protocol": protocol,
                "stream_interval": 1, "concurrency": 8, "rounds_output_tokens_per_s": tokens_per_s,
                "rounds_ttft_p50_ms": ttft}
    nan = float("nan")
    versus = versus_grpc([run("grpc", [100.0, 0.0, 50.0], [10.0, nan, 30.0]),
                          run("openai", [90.0, 80.0, 50.0], [12.0, 11.0, 31.0]),
                          run("tgi", [0.0, 0.0, 0.0], [nan, nan, nan])])
    openai = versus["tritonlm served (openai) concurrency=8"]
    assert openai["ratio_rounds"] == [0.9, 1.0] and openai["ratio"] == 0.9
    assert openai["ttft_p50_diff_ms_rounds"] == [2.0, 1.0] and openai["ttft_p50_diff_ms"] == 1.0
    assert math.isnan(versus["tritonlm served (tgi) concurrency=8"]["ratio"])
    print_versus_grpc(versus)
    printed = capsys.readouterr().out
    assert "openai / grpc at concurrency=8: 0.90x output tokens/s (median of 2 rounds: " \
        "0.90x..1.00x); median TTFT +1.0 ms" in printed
    assert "tgi / grpc at concurrency=8: no round where both streamed tokens" in printed


def test_openai_chunks_are_counted_at_the_stream_interval():
    assert chunk_sizes(5, 5, 4) == [1] * 5
    assert chunk_sizes(10, 4, 4) == [1, 4, 4, 1]
    assert chunk_sizes(9, 3, 4) == [1, 4, 4]
    assert chunk_sizes(10, 3, 4) is None  # 4 + 4 + 1 cannot carry 10
    assert chunk_sizes(10, 4, 1) is None


def test_a_running_server_needs_the_url_of_each_protocol():
    def urls(*argv):
        return server_urls(build_parser().parse_args(["--mode", "serve", *argv]))
    assert urls("--protocol", "grpc", "openai") is None  # none named: the bench starts one
    assert urls("--url", "h:1", "--frontend-url", "http://h:2", "--protocol", "grpc", "tgi") == {
        "grpc": "h:1", "tgi": "http://h:2"}
    with pytest.raises(SystemExit, match="--frontend-url"):
        urls("--url", "h:1", "--protocol", "grpc", "openai")
    with pytest.raises(SystemExit, match="--url"):
        urls("--frontend-url", "http://h:2", "--protocol", "openai", "grpc")
    with pytest.raises(SystemExit, match="apart"):
        urls("--url", "h:1", "--protocol", "grpc", "http")


def test_served_over_grpc_counts_failed_requests_apart_from_the_others(smollm2_server,
                                                                       smollm2_repo, tmp_path):
    # Prompts of max_model_len tokens or more fail, each alone; the others stream every token.
    args = ["--num-requests", "8", "--workload", "random", "--input-range", "100,900",
            "--output-range", "2,6", "--seed", "3"]
    requests = build_workload(build_parser().parse_args(args), smollm2_repo)
    ok = [r for r in requests if len(r.prompt_token_ids) < SERVED_MAX_MODEL_LEN]
    assert 0 < len(ok) < len(requests)
    out = tmp_path / "served.json"
    main(["--model", str(smollm2_repo), "--mode", "serve", "--url", smollm2_server.grpc_url,
          "--served-model", "llm", "--concurrency", "4", *args, "--json", str(out)])
    (run,) = _runs(out).values()
    assert (run["completed"], run["failed"]) == (len(ok), len(requests) - len(ok))
    assert all("max_model_len" in error for error in run["errors"])
    assert run["output_tokens"] == sum(
        min(r.output_len, SERVED_MAX_MODEL_LEN - len(r.prompt_token_ids)) for r in ok)


def test_served_over_http_sse_by_request_rate_reports_bad_requests(smollm2_server, smollm2_repo,
                                                                   tmp_path):
    out = tmp_path / "served.json"
    # Prompts longer than the served max_model_len fail one by one; the run still completes.
    main(["--model", str(smollm2_repo), "--mode", "serve", "--url", smollm2_server.http_url,
          "--protocol", "http", "--request-rate", "20", "--num-requests", "3",
          "--workload", "random", "--input-range", "4,12", "--output-range", "3,5",
          "--json", str(out)])
    (run,) = _runs(out).values()
    assert run["request_rate"] == 20 and run["completed"] == 3
    assert 9 <= run["output_tokens"] <= 15
    assert run["itl_ms"]["p50"] > 0

    main(["--model", str(smollm2_repo), "--mode", "serve", "--url", smollm2_server.http_url,
          "--protocol", "http", "--num-requests", "2", "--input-len", "600", "--output-len", "4",
          "--json", str(out)])
    (run,) = _runs(out).values()
    assert run["failed"] == 2 and "max_model_len" in run["errors"][0]
    assert math.isnan(run["ttft_ms"]["p50"])


def test_offline_and_served_in_one_run_starts_its_own_server(smollm2_repo, tmp_path):
    """The bench starts tritonserver, and the front end beside it for openai."""
    out = tmp_path / "both.json"
    main(["--model", str(smollm2_repo), "--mode", "offline", "serve", "--concurrency", "3",
          "--protocol", "grpc", "openai", "--num-requests", "3", "--input-len", "8",
          "--output-len", "5", "--json", str(out)])
    report = json.loads(out.read_text())
    runs = _runs(out)
    served = runs["tritonlm served (grpc) concurrency=3"]
    assert runs["tritonlm offline"]["output_tokens"] == served["output_tokens"] == 15
    assert runs["tritonlm served (openai) concurrency=3"]["output_tokens"] == 15
    assert report["ratios"]["tritonlm served (grpc) concurrency=3"] == pytest.approx(
        runs["tritonlm offline"]["output_tokens_per_s"] / served["output_tokens_per_s"])
    assert (tmp_path / "both.server.log").read_text()  # the server's log is kept beside
    # its own server's processes are read: the cores by part, the engine's wait for a core
    assert served["cpu_cores"]["engine"] > 0 and served["engine_waiting"] >= 0, served


def test_rounds_alternate_systems_and_never_reuse_cached_prompts(smollm2_server, smollm2_repo,
                                                                  tmp_path):
    out = tmp_path / "rounds.json"
    before = scrape(smollm2_server)
    main(["--model", str(smollm2_repo), "--mode", "offline", "serve", "--url",
          smollm2_server.grpc_url, "--served-model", "llm", "--concurrency", "1,2",
          "--num-requests", "2", "--input-len", "64", "--output-len", "3", "--rounds", "3",
          "--json", str(out)])
    after = scrape(smollm2_server)
    # 6 served runs of the same 64-token prompts (4 full blocks each) and none hit the cache.
    assert delta(before, after, "prefix_cache_queries_total") > 0
    assert delta(before, after, "prefix_cache_hits_total") == 0
    report = json.loads(out.read_text())
    runs = _runs(out)
    ours = runs["tritonlm offline"]["rounds_output_tokens_per_s"]
    for name, run in runs.items():
        rounds = run["rounds_output_tokens_per_s"]
        assert len(rounds) == 3 and run["output_tokens"] == 6
        assert run["output_tokens_per_s"] == sorted(rounds)[1]  # the median round's figures
        if name != "tritonlm offline":
            paired = sorted(a / b for a, b in zip(ours, rounds))
            assert report["ratio_rounds"][name] == pytest.approx([a / b for a, b in
                                                                  zip(ours, rounds)])
            assert report["ratios"][name] == pytest.approx(paired[1])


def test_roofline_counts_the_matmul_flops_of_transformers_linear_layers(tmp_path, smollm2_tokenizer,
                                                                        capsys):
    """Per token, our model's linear layers and head multiply-add what transformers' nn.Linear
    layers do (a tied lm_head included); the report puts a run's FLOPs against the peak."""
    from torch import nn

    from tritonlm import LLM
    from tritonlm.bench.roofline import matmul_flops_per_token
    hf, repo = tiny_llama(tmp_path, smollm2_tokenizer, tie_word_embeddings=True)
    with LLM(str(repo), num_kv_blocks=16) as llm:
        body, head = matmul_flops_per_token(llm.engine.runner.model)
    expected = sum(m.in_features * m.out_features for m in hf.modules()
                   if isinstance(m, nn.Linear))
    assert body + head == 2 * expected
    assert head == 2 * hf.lm_head.in_features * hf.lm_head.out_features
    main(["--model", str(repo), "--num-requests", "2", "--input-len", "8",
          "--output-len", "4", "--roofline"])
    printed = capsys.readouterr().out
    assert "of the measured matmul peak" in printed and "batch-1 decode:" in printed


def test_kernel_profile_tables_each_scenario(tmp_path, smollm2_tokenizer, capsys):
    from tritonlm.bench import kernel_profile
    _, repo = tiny_llama(tmp_path, smollm2_tokenizer)
    kernel_profile.main(["--model", str(repo), "--prompt-len", "40", "--decode-tokens", "6",
                         "--batch", "3", "--batch-prompt-len", "20", "--batch-tokens", "4"])
    printed = capsys.readouterr().out
    sections = printed.split("=== ")[1:]
    assert [s.split(":")[0] for s in sections] == ["prompt", "decode", "batch"]
    assert sections[0].startswith("prompt: 1 x 40 prompt tokens, 1 output tokens")
    assert sections[2].startswith("batch: 3 x 20 prompt tokens, 12 output tokens")
    assert all("aten::" in s for s in sections)  # each its table of the ops that ran
