"""The requests a benchmark sends: token-id prompts with the number of tokens each must generate."""
import json
import random
from dataclasses import dataclass
from pathlib import Path

# Random prompts skip the low ids, where tokenizers keep their special tokens.
_FIRST_ORDINARY_ID = 100


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # generated exactly (EOS ignored), so every engine does the same work
    lora_name: str | None = None  # the LoRA adapter it asks for


def _random_ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(_FIRST_ORDINARY_ID, vocab_size) for _ in range(length)]


def fixed(num: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0
          ) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(_random_ids(rng, input_len, vocab_size), output_len) for _ in range(num)]


def random_lengths(num: int, input_range: tuple[int, int], output_range: tuple[int, int],
                   vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Lengths uniform in the inclusive ranges."""
    rng = random.Random(seed)
    return [BenchRequest(_random_ids(rng, rng.randint(*input_range), vocab_size),
                         rng.randint(*output_range)) for _ in range(num)]


def shared_prefix(num: int, prefix_len: int, suffix_len: int, output_len: int, vocab_size: int,
                  seed: int = 0) -> list[BenchRequest]:
    """Many requests behind one long common system prompt, each with its own question."""
    rng = random.Random(seed)
    prefix = _random_ids(rng, prefix_len, vocab_size)
    return [BenchRequest(prefix + _random_ids(rng, suffix_len, vocab_size), output_len)
            for _ in range(num)]


def renamed(requests: list[BenchRequest], vocab_size: int, seed: float) -> list[BenchRequest]:
    """The same requests with every ordinary token id swapped through one random permutation:
    the same lengths and the same shared prefixes, none of them in a prefix cache that an
    earlier run of the originals filled."""
    ordinary = list(range(_FIRST_ORDINARY_ID, vocab_size))
    shuffled = ordinary.copy()
    random.Random(seed).shuffle(shuffled)
    swap = dict(zip(ordinary, shuffled))
    return [BenchRequest([swap.get(t, t) for t in r.prompt_token_ids], r.output_len)
            for r in requests]


def sharegpt(path: Path, tokenize, num: int, max_model_len: int, seed: int = 0
             ) -> list[BenchRequest]:
    """ShareGPT-format conversations: each first human turn is a prompt and the reply that
    follows gives the output length, as vLLM's benchmark reads them. `tokenize(text)` gives ids."""
    conversations = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    rng.shuffle(conversations)
    requests = []
    for entry in conversations:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = tokenize(turns[0]["value"]), tokenize(turns[1]["value"])
        # vLLM's filter: drop the very short and the ones that cannot fit.
        if len(prompt) < 4 or len(reply) < 4 or len(prompt) + len(reply) > max_model_len:
            continue
        requests.append(BenchRequest(prompt, len(reply)))
        if len(requests) == num:
            break
    if not requests:
        raise ValueError(f"{path} holds no usable ShareGPT conversation")
    return requests
