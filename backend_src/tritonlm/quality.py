"""Quality and memory of a converted model: perplexity over a text, computed by the engine's own
model and paged KV cache (so quantized weights and an int8 cache count), weight bytes, KV blocks
and greedy continuations of a few prompts.

python -m tritonlm.quality --model REPO/NAME [--text FILE] [--kv-cache-dtype int8] [--window 512]
                           [--prompt TEXT ...] [--max-tokens 24]
python -m tritonlm.quality --compare [--source SRC] [--group-size N ...] [--calibration FILE]
                           [--calibration-sequences N]
    float / round-to-nearest int4 / GPTQ / AWQ at each group size (quality_compare.py)

The default text is chapters I-II of Natsume's "Botchan" (Project Gutenberg EBook #8868, public
domain; about 10,400 SmolLM2 tokens); chapters III-XI are the GPTQ calibration text.
"""
import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from tritonlm.config import WEIGHTS_DIR
from tritonlm.engine.llm_engine import LLMEngine, resolve_model_dir
from tritonlm.engine.sequence import Sequence
from tritonlm.engine.step_plan import ScheduledChunk
from tritonlm.offline import LLM
from tritonlm.quality_compare import compare, table
from tritonlm.sampling_params import SamplingParams

TEXTS = Path(__file__).parents[2] / "tests/data"
PROMPTS = ("The capital of France is", "Once upon a time,", "def fibonacci(n):")


@torch.inference_mode()
def perplexity(engine: LLMEngine, token_ids: list[int], window: int) -> float:
    """exp(mean next-token NLL), over consecutive windows each prefilled into the cache alone."""
    if engine.config.tensor_parallel_size != 1 or engine.hf_config.is_encoder_decoder:
        raise ValueError("perplexity is measured on single-rank decoder-only models")
    runner, blocks = engine.runner, engine.block_manager
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        tokens = token_ids[start:start + window + 1]
        seq = Sequence(-1, "quality", tokens, SamplingParams(), 0, len(tokens))
        blocks.grow(seq, len(tokens))
        try:
            chunk = ScheduledChunk(seq.seq_id, tokens, 0, list(seq.block_table), None,
                                   len(tokens), False)
            inputs = runner.inputs.build([chunk])
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
            logits = runner.model.compute_logits(hidden[:-1]).float()
            targets = inputs.input_ids[1:]
            total += F.cross_entropy(logits, targets, reduction="sum").item()
            count += len(tokens) - 1
        finally:
            blocks.free(seq)
    return math.exp(total / count)


def weight_bytes(model_dir: str | Path) -> int:
    weights = resolve_model_dir(model_dir) / WEIGHTS_DIR
    return sum(p.stat().st_size for p in weights.glob("rank*.safetensors"))


def report(model_dir: str, text: str, window: int, prompts=PROMPTS, max_tokens: int = 24,
           **overrides) -> dict:
    with LLM(model_dir, **overrides) as llm:
        engine = llm.engine
        token_ids = engine.tokenizer.encode(text)
        greedy = llm.generate(list(prompts), SamplingParams(temperature=0, max_tokens=max_tokens))
        return {"model": str(model_dir), "kv_cache_dtype": engine.config.kv_cache_dtype,
                "dtype": engine.config.dtype, "tokens": len(token_ids),
                "perplexity": perplexity(engine, token_ids, window),
                "weight_bytes": weight_bytes(model_dir), "kv_blocks": engine.runner.num_blocks,
                "kv_cache_memory": engine.config.kv_cache_memory,
                "greedy": {prompt: out.text for prompt, out in zip(prompts, greedy)}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--model", help="a converted model directory")
    target.add_argument("--compare", action="store_true",
                        help="convert SRC as float, RTN int4, GPTQ and AWQ at each group size and tabulate")
    parser.add_argument("--source", default="default",
                        help="--compare: the float model (a Hugging Face directory or GGUF file; default SmolLM2)")
    parser.add_argument("--group-size", type=int, nargs="+", default=[32, 64, 128],
                        help="--compare: int4 group sizes (default 32 64 128)")
    parser.add_argument("--calibration", default=str(TEXTS / "botchan_chapters_3_11.txt"),
                        help="--compare: GPTQ and AWQ calibration text (default: Botchan, chapters III-XI)")
    parser.add_argument("--calibration-sequences", type=int, default=128,
                        help="--compare: pieces of 512 tokens GPTQ and AWQ calibrate on (default 128)")
    parser.add_argument("--work", default=str(Path.home() / ".cache/tritonlm/quality"),
                        help="--compare: where the converted variants are kept")
    parser.add_argument("--text", default=str(TEXTS / "botchan_chapters_1_2.txt"),
                        help="the text to score (default: Botchan, chapters I-II)")
    parser.add_argument("--window", type=int, default=512, help="tokens per scored window")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"))
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--prompt", action="append", help="a prompt to continue greedily "
                        "(repeatable; default: three fixed prompts)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per greedy continuation")
    args = parser.parse_args(argv)
    if args.compare:
        rows = compare(args.source, args.group_size, Path(args.calibration), args.calibration_sequences,
                       Path(args.text).read_text(), Path(args.work), args.window)
        print(table(rows))
        return
    result = report(args.model, Path(args.text).read_text(), args.window,
                    args.prompt or PROMPTS, args.max_tokens,
                    kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
