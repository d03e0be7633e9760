"""Offline throughput: tritonlm's engine next to HF transformers `generate` on the same requests.

python -m tritonlm.bench [--model DIR] [--requests 32] [--input-len 128] [--output-len 128]
"""
import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tritonlm.config import WEIGHTS_DIR
from tritonlm.engine.llm_engine import resolve_model_dir
from tritonlm.offline import LLM
from tritonlm.sampling_params import SamplingParams


def default_model_dir(cache: Path) -> Path:
    """The embedded SmolLM2, converted once into `cache`."""
    repo = cache / "bench_repo"
    if not (repo / "llm" / "1" / WEIGHTS_DIR).is_dir():
        converter = Path(sys.executable).parent / "tritonlm-convert"
        subprocess.run([str(converter), "default", "--output", str(repo)], check=True)
    return repo / "llm"


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Skip the low ids, where tokenizers keep their special tokens.
    return torch.randint(100, vocab_size, (n, length), generator=generator).tolist()


def bench_tritonlm(llm: LLM, prompts, output_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / elapsed


def load_hf_model(model_dir: Path, dtype: str):
    """transformers' own implementation holding the same (converted) weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    weights = resolve_model_dir(model_dir) / WEIGHTS_DIR
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(weights),
                                             dtype=getattr(torch, dtype))
    result = model.load_state_dict(load_file(weights / "rank0.safetensors"), strict=False)
    missing = set(result.missing_keys) - {"lm_head.weight"}  # tied to the embedding
    if missing:
        raise ValueError(f"weights missing for transformers' model: {sorted(missing)[:5]}")
    model.tie_weights()
    return model.eval()


def bench_hf(model, prompts, output_len: int, batch_size: int) -> float:
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = torch.tensor(prompts[i:i + batch_size])
        with torch.inference_mode():
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                 max_new_tokens=output_len, eos_token_id=None,
                                 pad_token_id=0)
        generated += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    return generated / (time.perf_counter() - start)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="converted model dir (default: SmolLM2)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-single-requests", type=int, default=4,
                        help="requests HF runs one at a time (tokens/s is measured on these)")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype of both engines")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or default_model_dir(Path(tmp))
        llm = LLM(str(model_dir), dtype=args.dtype)
        prompts = random_prompts(args.requests, args.input_len, llm.engine.vocab_size)
        results = {"tritonlm": bench_tritonlm(llm, prompts, args.output_len)}
        del llm
        if not args.skip_hf:
            hf = load_hf_model(model_dir, args.dtype)
            results["hf one at a time"] = bench_hf(hf, prompts[:args.hf_single_requests],
                                                   args.output_len, 1)
            results[f"hf static batch {args.hf_batch_size}"] = bench_hf(
                hf, prompts, args.output_len, args.hf_batch_size)
    print(f"{args.requests} requests x {args.input_len} prompt / {args.output_len} output tokens, "
          f"greedy, EOS ignored, {args.dtype}, {torch.get_num_threads()} threads")
    ours = results["tritonlm"]
    for name, tps in results.items():
        ratio = "" if name == "tritonlm" else f"  (tritonlm is {ours / tps:.1f}x)"
        print(f"  {name:24s} {tps:9.1f} output tokens/s{ratio}")


if __name__ == "__main__":
    main()
