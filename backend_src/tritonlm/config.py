"""Engine settings (`1/engine.json`) and the layout of a converted model directory."""
import dataclasses
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tritonlm.sampling_params import MAX_LOGPROBS, MAX_SEQUENCES

ENGINE_FILE = "engine.json"
WEIGHTS_DIR = "weights"
# The CPU KV cache's bytes, over engine.json's kv_cache_memory (vLLM's VLLM_CPU_KVCACHE_SPACE):
# sized where the model is deployed, without converting it again
KV_CACHE_MEMORY_VARIABLE = "TRITONLM_KV_CACHE_MEMORY"
DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model dtype
# What quantized weights multiply on CPU: the float inputs, or (decode batches, short prompts)
# the inputs quantized to int8 (w4a8, w8a8: faster where widening the weights bounds the float
# path);
# auto: int8 on CPUs without AVX512 (engine/auto_dtype.py)
QUANTIZED_ACTIVATIONS = ("auto", "float", "int8")


# num_speculative_tokens where engine.json leaves it unset, by proposer. SmolLM2 at batch 1 on 2
# Zen 4 cores (tritonlm-bench --rounds 3): prompt lookup on the grounded workload, K = 4 / 6 / 8,
# TPOT 1.76x / 2.02x / 2.21x lower (a sequence proposes at most twice what it last kept, plus two,
# so where nothing is copied a long K costs little); its int4 copy as the draft on chat, K = 3 /
# 5 / 8: 6.6-7.1 / 5.7-6.2 / 6.5 ms a token (the draft's steps after its first run as one decode
# run).
NGRAM_SPECULATIVE_TOKENS = 8
DRAFT_SPECULATIVE_TOKENS = 5


@dataclass
class EngineConfig:
    # "auto": the fastest where the engine loads (engine/auto_dtype.py)
    dtype: str = "auto"
    max_model_len: int = 2048
    block_size: int = 16
    # KV blocks to allocate; None sizes the cache: from kv_cache_memory on CPU, on CUDA from
    # gpu_memory_utilization (the fraction of the GPU this instance may use, weights included).
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    quantized_activations: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # KV blocks of output kept free for each running sequence before a waiting request starts
    # (Scheduler._blocks_to_come; 0: whenever its prompt fits, as in vLLM)
    admission_headroom_blocks: int = 2
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    # A streamed request gets its first tokens at once, then a response per this many new tokens
    # (and its last); above 1 each response costs the transport less (vLLM's --stream-interval).
    stream_interval: int = 1
    device: str = "auto"
    # Run decode steps eagerly instead of replaying CUDA graphs or CPU op programs
    # (engine/decode_graphs.py)
    enforce_eager: bool = False
    # Decode steps one schedule may run in a row, inputs from the device (engine/decode_run.py;
    # vLLM's name); None: 8 on CUDA, 1 on CPU. Runs need the decode graphs (not enforce_eager,
    # one rank) and only take sequences whose sampling needs no host state between tokens.
    num_scheduler_steps: int | None = None
    # Speculative decoding (engine/speculation.py, vLLM's names): "ngram" (prompt lookup of
    # prompt_lookup_max down to prompt_lookup_min tokens) or a draft model's repository proposes
    # up to num_speculative_tokens tokens a step that one target step verifies, while fewer
    # than speculative_disable_by_batch_size sequences run (above that, a step is bound by
    # compute, not by reading the weights).
    speculative: str | None = None
    num_speculative_tokens: int | None = None  # None: the proposer's (speculative_tokens)
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    speculative_disable_by_batch_size: int = 8
    # TGI's watermark (tritonlm/watermark.py), for requests that ask: the green list's share of
    # the vocabulary and the logit added on it
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0
    # Limits (TGI's names and meanings): requests in flight at once, beyond which a request is
    # refused at once (Triton's UNAVAILABLE; 429 through the front end); a prompt's tokens, and
    # its tokens plus max_tokens (None: max_model_len - 1 and max_model_len; within them an
    # unset max_tokens fills max_total_tokens); seconds a request may wait for its first step
    # before it fails as overloaded (None: no limit)
    max_concurrent_requests: int = 128
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    queue_timeout: float | None = None
    # What one request may ask for: sequences (n, best_of), stop strings, and top alternatives
    # per token (logprobs, prompt_logprobs)
    max_best_of: int = MAX_SEQUENCES
    max_stop_sequences: int = 16
    max_top_n_tokens: int = MAX_LOGPROBS
    # LoRA adapters (the version's multi_lora.json): how many one step may serve (requests of
    # others wait), and the largest rank an adapter may have (None: the largest registered)
    max_loras: int = 4
    max_lora_rank: int | None = None
    # OTLP/HTTP traces endpoint (TRITONLM_OTLP_ENDPOINT overrides it); None: no tracing
    otlp_endpoint: str | None = None

    def __post_init__(self):
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto or one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError(f"quantized_activations must be one of {QUANTIZED_ACTIVATIONS}, "
                             f"got {self.quantized_activations!r}")
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size", "kv_cache_memory", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 < self.watermark_gamma < 1:
            raise ValueError(f"watermark_gamma must be in (0, 1), got {self.watermark_gamma}")
        if not self.watermark_delta > 0:
            raise ValueError(f"watermark_delta must be > 0, got {self.watermark_delta}")
        if self.admission_headroom_blocks < 0:
            raise ValueError(f"admission_headroom_blocks must be >= 0, "
                             f"got {self.admission_headroom_blocks}")
        if self.num_scheduler_steps is not None and self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        self._check_speculative()
        self._check_limits()
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")

    def _check_limits(self) -> None:
        if self.max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}")
        total = self.max_total_tokens if self.max_total_tokens is not None else self.max_model_len
        if not 1 < total <= self.max_model_len:
            raise ValueError(f"max_total_tokens must be in [2, max_model_len ({self.max_model_len})], "
                             f"got {total}")
        if self.max_input_tokens is not None and not 0 < self.max_input_tokens < total:
            raise ValueError(f"max_input_tokens must be in [1, max_total_tokens ({total}) - 1], "
                             f"got {self.max_input_tokens}")
        if self.queue_timeout is not None and not self.queue_timeout > 0:
            raise ValueError(f"queue_timeout must be > 0 seconds, got {self.queue_timeout}")
        if not 1 <= self.max_best_of <= MAX_SEQUENCES:
            raise ValueError(f"max_best_of must be in [1, {MAX_SEQUENCES}], got {self.max_best_of}")
        if not 0 <= self.max_top_n_tokens <= MAX_LOGPROBS:
            raise ValueError(f"max_top_n_tokens must be in [0, {MAX_LOGPROBS}], "
                             f"got {self.max_top_n_tokens}")
        if self.max_loras < 1 or (self.max_lora_rank is not None and self.max_lora_rank < 1):
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} "
                             f"and {self.max_lora_rank}")
        if self.max_stop_sequences < 0:
            raise ValueError(f"max_stop_sequences must be >= 0, got {self.max_stop_sequences}")

    @property
    def total_token_limit(self) -> int:
        """max_total_tokens as it applies: a prompt's tokens plus those it may generate (within
        max_model_len, which the engine lowers to the model's context where that is shorter)."""
        return min(self.max_total_tokens or self.max_model_len, self.max_model_len)

    @property
    def input_token_limit(self) -> int:
        """max_input_tokens as it applies."""
        return (self.max_input_tokens if self.max_input_tokens is not None
                else self.total_token_limit - 1)

    @property
    def speculative_tokens(self) -> int:
        """num_speculative_tokens, or where unset the proposer's default."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return NGRAM_SPECULATIVE_TOKENS if self.speculative == "ngram" else DRAFT_SPECULATIVE_TOKENS

    def _check_speculative(self) -> None:
        if self.speculative is not None and not (isinstance(self.speculative, str)
                                                 and self.speculative.strip()):
            raise ValueError(f"speculative must be null, \"ngram\" or a draft model's "
                             f"repository, got {self.speculative!r}")
        for name, value in (("num_speculative_tokens", self.speculative_tokens),
                            ("prompt_lookup_min", self.prompt_lookup_min),
                            ("speculative_disable_by_batch_size",
                             self.speculative_disable_by_batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({self.prompt_lookup_min})")

    @classmethod
    def load(cls, model_dir: str | Path, **overrides) -> "EngineConfig":
        path = Path(model_dir) / ENGINE_FILE
        values = json.loads(path.read_text()) if path.exists() else {}
        if memory := os.environ.get(KV_CACHE_MEMORY_VARIABLE):
            values["kv_cache_memory"] = parse_memory_size(memory, KV_CACHE_MEMORY_VARIABLE)
        values.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown engine settings {sorted(unknown)} in {path}")
        return cls(**values)

    def save(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / ENGINE_FILE
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")


_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9,
          "TB": 10 ** 12, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_memory_size(text: str, what: str = "memory size") -> int:
    """'4GiB', '512MB', '1073741824' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and _UNITS.get(match[2].upper())
    if unit is None or float(match[1]) * unit < 1:
        raise ValueError(f"not a {what}: {text!r} (examples: 4GiB, 512MiB, 1000000)")
    return int(float(match[1]) * unit)


def linked_repository(model_dir: Path, directory: Path, **engine_settings) -> Path:
    """A repository serving `model_dir`'s weights (linked, not copied) as model "llm", with
    `engine_settings` over its engine.json (tritonlm-stress, tests)."""
    version = directory / "llm" / "1"
    version.mkdir(parents=True)
    shutil.copy(model_dir / "config.pbtxt", directory / "llm" / "config.pbtxt")
    shutil.copy(model_dir / "1" / "model.py", version / "model.py")
    (version / WEIGHTS_DIR).symlink_to((model_dir / "1" / WEIGHTS_DIR).resolve())
    settings = json.loads((model_dir / "1" / ENGINE_FILE).read_text())
    settings.update(engine_settings)
    (version / ENGINE_FILE).write_text(json.dumps(settings))
    return directory
