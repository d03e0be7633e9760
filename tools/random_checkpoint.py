"""A Hugging Face checkpoint of a published model's shape with random weights, for benchmarks at
sizes no model here has (nothing is downloaded):

  python tools/random_checkpoint.py llama-3-8b --tokenizer TOKENIZER_DIR --output DIR
  tritonlm-convert DIR --output REPO --dtype bfloat16

The tensor names and shapes are transformers' own for the config (built on the meta device);
matrices are N(0, 0.02) (transformers' initializer range), norms ones, drawn on a GPU when there
is one. The tokenizer is any saved one; token ids past its vocabulary are still valid inputs."""
import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

SHAPES = {
    "llama-3-8b": lambda: LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, dtype="bfloat16"),
}
SHARD_BYTES = 4 << 30


def write_random_checkpoint(config, output: Path, dtype: torch.dtype, device: torch.device) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    config.architectures = [type(model).__name__]
    output.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(output)
    generator = torch.Generator(device).manual_seed(0)
    shard, shard_bytes, weight_map, files = {}, 0, {}, []

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, output / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        files.append(name)
        shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        if name.endswith("norm.weight") or len(shape) == 1:
            tensor = torch.ones(shape, dtype=dtype)
        else:
            tensor = (torch.randn(shape, generator=generator, device=device) * 0.02).to(dtype).cpu()
        shard[name] = tensor
        shard_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    total = sum(shapes[n].numel() for n in shapes) * torch.finfo(dtype).bits // 8
    (output / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=SHAPES)
    parser.add_argument("--tokenizer", required=True, help="a saved tokenizer's directory")
    parser.add_argument("--output", "-o", required=True, type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    write_random_checkpoint(SHAPES[args.shape](), args.output, torch.bfloat16, device)
    AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(args.output)


if __name__ == "__main__":
    main()
