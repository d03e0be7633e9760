"""Where the engine's device time goes: torch.profiler's table of kernels for three scenarios.

  python -m tritonlm.bench.kernel_profile --model REPO/NAME [--prompt-len 2048] [--batch 256]

- `prompt`: one prompt of --prompt-len tokens and one output token (TTFT's kernels);
- `decode`: one 128-token prompt and --decode-tokens outputs (batch-1 decode steps);
- `batch`: --batch prompts of --batch-prompt-len tokens, --batch-tokens outputs each, all at once
  (prefill chunks beside large decode batches).

Each runs once untimed (compilation, graph capture), then prints its wall time without the
profiler, the device's total op time under it, and its ops by their own device time (CPU time on
a CPU). tools/gpu_check.sh's profile section runs it on the 8B-shaped model.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tritonlm import LLM, SamplingParams


def scenarios(args, vocab_size: int) -> dict[str, tuple[list[list[int]], SamplingParams]]:
    g = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(3, vocab_size, (n, length), generator=g).tolist()

    def params(tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    return {"prompt": (prompts(1, args.prompt_len), params(1)),
            "decode": (prompts(1, 128), params(args.decode_tokens)),
            "batch": (prompts(args.batch, args.batch_prompt_len), params(args.batch_tokens))}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(llm: LLM, name: str, prompts: list[list[int]], params: SamplingParams,
        row_limit: int) -> str:
    device = llm.engine.runner.device
    llm.generate(prompts, params)  # compiles kernels, captures graphs
    _synchronize(device)
    start = time.perf_counter()
    llm.generate(prompts, params)
    _synchronize(device)
    wall = time.perf_counter() - start
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        llm.generate(prompts, params)
        _synchronize(device)
    events = prof.key_averages()
    key = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    op_us = sum(getattr(e, key) for e in events)
    tokens = len(prompts) * params.max_tokens
    return (f"=== {name}: {len(prompts)} x {len(prompts[0])} prompt tokens, {tokens} output "
            f"tokens: {wall * 1e3:.1f} ms wall unprofiled; {op_us / 1e3:.1f} ms of "
            f"{'device' if on_cuda else 'CPU'} time profiled\n"
            + events.table(sort_by=key, row_limit=row_limit))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a converted model, REPO/NAME")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batch-prompt-len", type=int, default=512)
    p.add_argument("--batch-tokens", type=int, default=32)
    p.add_argument("--only", nargs="+", choices=("prompt", "decode", "batch"))
    p.add_argument("--rows", type=int, default=30, help="table rows per scenario")
    args = p.parse_args(argv)
    # Without the prefix cache every run computes its prompts again.
    llm = LLM(args.model, max_num_seqs=args.batch, enable_prefix_caching=False)
    for name, (prompts, params) in scenarios(args, llm.engine.vocab_size).items():
        if args.only is None or name in args.only:
            print(run(llm, name, prompts, params, args.rows), flush=True)


if __name__ == "__main__":
    main()
