"""Weight quantization methods side by side: float, round-to-nearest int4, GPTQ and AWQ at each
group size, each converted by `tritonlm-convert` from the same float model and scored by
quality.py on held-out text (perplexity, weight bytes, greedy match with the float model).

python -m tritonlm.quality --compare [--source SRC] [--group-size 32 64 128 ...]
                           [--calibration FILE] [--calibration-sequences N] [--work DIR]

SRC (default: the embedded SmolLM2 GGUF) is a Hugging Face directory, or a GGUF file which
transformers loads and saves as one (GPTQ and AWQ calibrate on transformers' model). Greedy match:
over prompts cut from the scored text, the share of the float model's greedy tokens a variant
reproduces before its first differing token. The LM head is int8 in every quantized variant (the
converter's default).
"""
import json
import subprocess
import sys
from pathlib import Path

import torch

from tritonlm.offline import LLM
from tritonlm.sampling_params import SamplingParams

CONTINUATION_TOKENS = 32
PROMPT_TOKENS = 64
NUM_PROMPTS = 16


def float_directory(source: str, work: Path) -> Path:
    """SRC as a float Hugging Face directory: itself, or a GGUF file dequantized by transformers."""
    path = Path(source)
    if path.is_dir():
        return path
    target = work / "hf"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if source == "default":
        from tritonlm_convert.convert import default_gguf_path
        path = default_gguf_path()
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    config.__dict__.pop("quantization_config", None)  # transformers will not save "gguf" models
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(target)
    return target


def variants(group_sizes: list[int], calibration: Path, sequences: int) -> dict[str, list[str]]:
    """Name -> tritonlm-convert flags."""
    found = {"float": []}
    calibrated = ["--calibration", str(calibration), "--calibration-sequences", str(sequences)]
    for size in group_sizes:
        group = ["--group-size", str(size)]
        found[f"rtn g{size}"] = ["--quantize", "int4", *group]
        found[f"gptq g{size}"] = ["--quantize", "int4", *group, *calibrated]
        found[f"awq g{size}"] = ["--quantize", "awq", *group, *calibrated]
    return found


def converted(hf_dir: Path, output: Path, flags: list[str]) -> Path:
    if not (output / "llm" / "1").is_dir():
        converter = Path(sys.executable).parent / "tritonlm-convert"
        subprocess.run([str(converter), str(hf_dir), "--output", str(output), "--dtype", "float32",
                        *flags], check=True)
    return output / "llm"


def greedy_match(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Mean share of each reference continuation reproduced before the first difference."""
    shares = []
    for ours, theirs in zip(tokens, reference):
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        shares.append(same / len(theirs))
    return sum(shares) / len(shares)


def compare(source: str, group_sizes: list[int], calibration: Path, sequences: int, text: str,
            work: Path, window: int) -> list[dict]:
    from tritonlm.quality import perplexity, weight_bytes
    hf_dir = float_directory(source, work)
    rows, reference = [], None
    for name, flags in variants(group_sizes, calibration, sequences).items():
        model_dir = converted(hf_dir, work / name.replace(" ", "-"), flags)
        with LLM(str(model_dir)) as llm:
            token_ids = llm.engine.tokenizer.encode(text)
            step = (len(token_ids) - PROMPT_TOKENS) // NUM_PROMPTS
            prompts = [token_ids[i * step:i * step + PROMPT_TOKENS] for i in range(NUM_PROMPTS)]
            params = SamplingParams(temperature=0, max_tokens=CONTINUATION_TOKENS, ignore_eos=True)
            tokens = [out.token_ids for out in llm.generate(prompts, params)]
            reference = reference or tokens
            rows.append({"variant": name, "perplexity": perplexity(llm.engine, token_ids, window),
                         "weight_bytes": weight_bytes(model_dir),
                         "greedy_match": greedy_match(tokens, reference)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| variant | perplexity | weight MB | greedy match |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['perplexity']:.3f} | {r['weight_bytes'] / 1e6:.1f} | "
              f"{r['greedy_match']:.1%} |" for r in rows]
    return "\n".join(lines)
