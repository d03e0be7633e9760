#!/usr/bin/env python3
"""Runs a batch of token-id requests through vLLM's CPU build, for ``tritonlm-bench --compare vllm``.

This file is a STANDALONE SCRIPT. It runs under vLLM's own venv (``.venv-vllm/bin/python``, made
by ``tools/setup_vllm.sh``) and must never import tritonlm nor anything outside that venv: only
the standard library at import time, and vLLM inside ``run()``.

Modes
-----
Run the benchmark (under ``.venv-vllm/bin/python``)::

    python vllm_runner.py --model HF_DIR --requests REQUESTS.json --output RESULTS.json \
        [--dtype bfloat16|float32] [--max-model-len N] [--kv-cache-gib N] \
        [--max-num-seqs N] [--max-num-batched-tokens N] [--threads-bind SPEC] \
        [--omp iomp|gomp] [--engine-process inproc|mp] [--ttft] [--save-token-ids] \
        [--repeat N | --rounds-on-stdin]

  REQUESTS.json: ``[{"prompt_token_ids": [...], "max_tokens": 128}, ...]``; every request is
  run greedy (temperature 0) with ``ignore_eos=True`` and its own ``max_tokens``, all in one
  ``LLM.generate`` call, detokenizing as our engine does. A short warm-up generate runs first
  (on other token ids, so the prefix cache cannot help the timed run), then the full generate is
  timed with ``time.perf_counter``.

  RESULTS.json: ``{"elapsed_s": float, "output_tokens": [int per request], "vllm_version": str,
  "settings": {...}}`` plus ``"elapsed_runs_s"`` (one per ``--repeat`` or per round; elapsed_s is
  their median), ``"ttft_s": [float per request]`` with ``--ttft`` (vLLM fills
  ``RequestOutput.metrics`` only when its stats logging is on, which cost ~10% throughput here,
  so it is off by default) and ``"output_token_ids"`` with ``--save-token-ids``.
  ``settings.other_processes_cpu_s`` says how many CPU-seconds other programs (and hypervisor
  steal) took during each timed run: more than ~1 s means the figure was disturbed.

Make an HF model directory for vLLM out of a tritonlm weights directory (any Python >= 3.8,
stdlib only; our bench calls this from our own venv by running the script)::

    python vllm_runner.py --prepare-hf-dir WEIGHTS_DIR DEST

  ``vllm_env.hf_dir_for_vllm(weights_dir, dest)`` does it: DEST gets a symlink to every file of
  WEIGHTS_DIR, with ``rank0.safetensors`` linked as ``model.safetensors`` (tensor-parallel
  shards of other ranks are left out). The file may also be imported by path
  (``importlib.util.spec_from_file_location``); importing it does nothing else.

vLLM "at its best" on this CPU: what the settings are and why
--------------------------------------------------------------
* Compilation: we do not pass ``enforce_eager``. vLLM's CPU platform (vllm/platforms/cpu.py)
  turns the default VLLM_COMPILE mode into DYNAMO_TRACE_ONCE with the inductor backend (C++
  codegen, epilogue fusion); there are no CUDA graphs on CPU (cudagraph_capture_sizes is
  emptied). The model is compiled while the engine starts, before our warm-up.
* LD_PRELOAD: vLLM's CPU docs advise preloading tcmalloc and Intel OpenMP (libiomp5). A process
  cannot preload into itself, so when LD_PRELOAD lacks tcmalloc this script re-executes itself
  once with LD_PRELOAD set (tcmalloc from Debian's libtcmalloc-minimal4, libiomp5.so from the
  intel-openmp wheel in the venv). ``--omp gomp`` preloads tcmalloc only, and vLLM then adds
  PyTorch's own libgomp itself. The caller sets nothing.
  Measured here (SmolLM2-135M, 32 x 128 in / 128 out): libiomp5 beat libgomp by ~12%.
* Threads: vLLM's "auto" VLLM_CPU_OMP_THREADS_BIND reserves one core per rank for its
  engine-core (scheduler) process, which on this 2-core machine leaves the model one thread:
  ~40% slower than binding both. ``--threads-bind`` defaults to every CPU this process may use
  (``0-1`` here).
* Processes (``--engine-process``): by default vLLM runs the engine core and the model worker in
  two more processes (VLLM_ENABLE_V1_MULTIPROCESSING=1, "mp" executor), which compete with the
  OpenMP threads for the 2 cores. ``inproc`` (default) runs everything in this process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0, "uni" executor) with OMP_NUM_THREADS and KMP_AFFINITY set
  as vLLM would set them in its worker: ~11% more tokens/s here. ``--engine-process mp`` gives
  vLLM's stock layout.
* Scheduler: vLLM's CPU defaults (max_num_seqs 256, max_num_batched_tokens 4096, chunked
  prefill and prefix caching on, block size 128) measured as fast as any tuning tried
  (max_num_seqs 32 with 8192 batched tokens, 2048 or 1024 batched tokens, block size 64), so
  they are left alone unless ``--max-num-seqs`` / ``--max-num-batched-tokens`` are given.
* VLLM_CPU_KVCACHE_SPACE from ``--kv-cache-gib`` (default 4).
* Nothing downloads: HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, VLLM_NO_USAGE_STATS=1,
  DO_NOT_TRACK=1.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # Run as a script, Python puts this file's folder (tritonlm/bench/) first on sys.path; a
    # module there (vllm_compare.py, cli.py, ... or one day a "vllm.py") must never shadow vLLM's
    # venv, nor the standard library.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402


def _sibling(name: str):
    """A module of this folder, loaded by path (the folder itself is kept off sys.path)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vllm_env = _sibling("vllm_env")

# Line prefixes of --rounds-on-stdin on stdout (vLLM may log there too).
READY, ROUND = "vllm_runner ready ", "vllm_runner round "


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare-hf-dir", nargs=2, metavar=("WEIGHTS_DIR", "DEST"),
                   help="only make DEST, an HF directory for vLLM, out of WEIGHTS_DIR; then exit")
    p.add_argument("--model", help="HF model directory (see --prepare-hf-dir)")
    p.add_argument("--requests", help="REQUESTS.json")
    p.add_argument("--output", help="RESULTS.json to write")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16", "auto"])
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest request (prompt + max_tokens), at least 256")
    p.add_argument("--kv-cache-gib", type=float, default=4,
                   help="KV cache size in GiB: VLLM_CPU_KVCACHE_SPACE when a whole number, "
                        "else the engine argument kv_cache_memory_bytes")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's (256 on CPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: vLLM's (4096 on CPU)")
    p.add_argument("--threads-bind", default=None,
                   help="CPUs for the model's OpenMP threads, as VLLM_CPU_OMP_THREADS_BIND; "
                        "default: every CPU this process may use (e.g. 0-1). With "
                        "--engine-process mp, vLLM's 'auto' reserves a core for its scheduler "
                        "process; 'nobind' pins nothing")
    p.add_argument("--omp", choices=["iomp", "gomp"], default="iomp",
                   help="OpenMP runtime: iomp = preload Intel's libiomp5 (vLLM CPU docs' advice), "
                        "gomp = PyTorch's libgomp")
    p.add_argument("--engine-process", choices=["inproc", "mp"], default="inproc",
                   help="inproc (default, measured fastest here): vLLM's engine core and model "
                        "run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), OpenMP threads "
                        "pinned by us; mp: vLLM's default engine-core and worker processes, "
                        "pinned by vLLM from VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--ttft", action="store_true",
                   help="turn vLLM's stats on to report per-request ttft_s (costs a little)")
    p.add_argument("--save-token-ids", action="store_true",
                   help="also write output_token_ids (per request) to RESULTS.json, to check "
                        "greedy outputs against another engine")
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1,
                   help="time the full generate N times (prefix cache reset in between); "
                        "elapsed_s is the median, every run is in elapsed_runs_s")
    p.add_argument("--rounds-on-stdin", action="store_true",
                   help="after warm-up print a READY line (version and settings as JSON), then "
                        "time one generate per 'run' line read on stdin and print a ROUND line "
                        "(elapsed_s, output_tokens) after each, until another line or EOF: so "
                        "that a caller can alternate vLLM's runs with another system's")
    p.add_argument("--engine-args", default=None, metavar="JSON",
                   help='more vllm.LLM keyword arguments, e.g. \'{"enforce_eager": true}\' '
                        "(for experiments; recorded in settings)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if not args.prepare_hf_dir and not (args.model and args.requests and args.output):
        p.error("--model, --requests and --output are required (or --prepare-hf-dir)")
    return args


def run(args: argparse.Namespace) -> dict:
    env_used = vllm_env.setup_env(args)
    with open(args.requests) as f:
        requests = json.load(f)
    if not requests:
        raise SystemExit("vllm_runner: no requests")
    longest = max(len(r["prompt_token_ids"]) + int(r["max_tokens"]) for r in requests)
    max_model_len = args.max_model_len or max(256, longest)

    import vllm  # noqa: PLC0415 - only inside vLLM's venv
    from vllm import LLM, SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    engine_args = {
        "model": os.path.abspath(args.model),
        "tokenizer": os.path.abspath(args.model),
        "dtype": args.dtype,
        "max_model_len": max_model_len,
        "seed": 0,
        "disable_log_stats": not args.ttft,
    }
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        engine_args["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    if args.max_num_seqs is not None:
        engine_args["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.engine_args:
        engine_args.update(json.loads(args.engine_args))
    loadavg_before = os.getloadavg()

    t0 = time.perf_counter()
    llm = LLM(**engine_args)
    startup_s = time.perf_counter() - t0

    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in r["prompt_token_ids"]]) for r in requests]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=int(r["max_tokens"]),
                             detokenize=True) for r in requests]

    # Warm-up on other token ids (no prefix-cache hits for the timed run), same prompt length.
    n_warm = max(1, min(args.warmup_requests, len(requests)))
    plen = len(requests[0]["prompt_token_ids"])
    warm_prompts = [TokensPrompt(prompt_token_ids=[(17 + 31 * i + 7 * j) % 1000 + 10 for j in range(plen)])
                    for i in range(n_warm)]
    t0 = time.perf_counter()
    llm.generate(warm_prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8),
                 use_tqdm=False)
    warmup_s = time.perf_counter() - t0

    cfg = llm.llm_engine.vllm_config
    comp = cfg.compilation_config
    settings = {
        "env": env_used,
        "engine_args": engine_args,
        "resolved": {
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "enable_chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "block_size": cfg.cache_config.block_size,
            "compilation_mode": getattr(comp.mode, "name", str(comp.mode)),
            "compilation_backend": comp.backend,
            "enforce_eager": cfg.model_config.enforce_eager,
            "distributed_executor_backend": cfg.parallel_config.distributed_executor_backend,
        },
        "omp": args.omp,
        "engine_process": args.engine_process,
        "startup_s": round(startup_s, 3),
        "warmup_s": round(warmup_s, 3),
        "num_requests": len(requests),
        "loadavg_before": [round(x, 2) for x in loadavg_before],
        "other_processes_cpu_s": [],
        "own_cpu_s": [],
        "detokenize": True,
        "sampling": "greedy (temperature 0), ignore_eos",
    }

    def timed_run() -> tuple[float, list]:
        before = vllm_env.cpu_snapshot()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
        elapsed = time.perf_counter() - t0
        after = vllm_env.cpu_snapshot()
        if before and after:
            # CPU seconds that other programs used during this run: > a few % of
            # elapsed * cores means the measurement was disturbed.
            settings["other_processes_cpu_s"].append(
                round(max(0.0, (after[0] - before[0]) - (after[1] - before[1])), 2))
            settings["own_cpu_s"].append(round(after[1] - before[1], 2))
        llm.reset_prefix_cache()
        return elapsed, outputs

    def output_tokens(outputs) -> list[int]:
        return [sum(len(c.token_ids) for c in o.outputs) for o in outputs]

    runs, outputs = [], []
    if args.rounds_on_stdin:
        print(READY + json.dumps({"vllm_version": getattr(vllm, "__version__", "unknown"),
                                  "settings": settings}), flush=True)
        while sys.stdin.readline().strip() == "run":
            elapsed, outputs = timed_run()
            runs.append(elapsed)
            print(ROUND + json.dumps({"elapsed_s": elapsed,
                                      "output_tokens": sum(output_tokens(outputs))}), flush=True)
    else:
        for _ in range(max(1, args.repeat)):
            elapsed, outputs = timed_run()
            runs.append(elapsed)
    settings["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    result = {
        "elapsed_s": sorted(runs)[len(runs) // 2] if runs else None,
        "elapsed_runs_s": runs,
        "output_tokens": output_tokens(outputs),
        "vllm_version": getattr(vllm, "__version__", "unknown"),
        "settings": settings,
    }
    if args.save_token_ids:
        result["output_token_ids"] = [[int(t) for t in o.outputs[0].token_ids] for o in outputs]
    if args.ttft and outputs:
        ttft = [getattr(o.metrics, "first_token_latency", None) if o.metrics is not None else None
                for o in outputs]
        if ttft and all(isinstance(t, (int, float)) and t > 0 for t in ttft):
            result["ttft_s"] = ttft
    return result


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.prepare_hf_dir:
        print(vllm_env.hf_dir_for_vllm(*args.prepare_hf_dir))
        return 0
    if argv is None:
        vllm_env.reexec_with_preload(__file__, args.omp)
    result = run(args)
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, args.output)
    if result["elapsed_s"]:
        total = sum(result["output_tokens"])
        print(f"vllm_runner: {total} output tokens in {result['elapsed_s']:.3f} s = "
              f"{total / result['elapsed_s']:.1f} tok/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
