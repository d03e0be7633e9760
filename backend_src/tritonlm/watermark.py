"""TGI's watermark ("A Watermark for Large Language Models", Kirchenbauer et al., 2023).

Before the other logits transforms, a watermarked sequence's logits get `delta` added on a green
list of int(V * gamma) tokens, V the width of the logits. The green list follows the token
before the one being sampled: the first int(V * gamma) entries of torch.randperm(V) drawn on the
CPU from a generator seeded with HASH_KEY * that token (TGI's hash key), so a detector with the
tokenizer, gamma and V finds it again. The detector counts a text's green tokens, each distinct
(previous, token) bigram once, and gives the paper's z-score with its one-sided p-value:

    python -m tritonlm.watermark detect --model REPO/NAME TEXT|FILE
"""
import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

HASH_KEY = 15485863  # TGI's (gamma and delta: engine.json, TGI's defaults)


def green_list(previous_token: int, vocab_size: int, gamma: float) -> torch.Tensor:
    """The green token ids after `previous_token`."""
    generator = torch.Generator().manual_seed(HASH_KEY * previous_token)
    return torch.randperm(vocab_size, generator=generator)[:int(vocab_size * gamma)]


class GreenLists:
    """Green-list masks [V] by previous token, kept for the last `capacity` previous tokens: a
    step's known tokens are one gather, and only new ones draw a permutation."""

    def __init__(self, vocab_size: int, gamma: float, device: torch.device, capacity: int = 512):
        self.vocab_size, self.gamma = vocab_size, gamma
        self.masks = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self.slot_of = np.full(vocab_size, -1, dtype=np.int64)  # previous token -> its slot
        self.token_in = np.full(capacity, -1, dtype=np.int64)
        self.next_slot = 0  # slots are reused oldest first

    def masks_for(self, previous_tokens: list[int]) -> torch.Tensor:
        """[len(previous_tokens), V] bool: each row's green list."""
        tokens = np.asarray(previous_tokens, dtype=np.int64)
        slots = self.slot_of[tokens]
        out = self.masks[torch.from_numpy(np.maximum(slots, 0)).to(self.masks.device)]
        for token in np.unique(tokens[slots < 0]):
            mask = self._store(int(token))
            out[torch.from_numpy(np.flatnonzero(tokens == token)).to(out.device)] = mask
        return out

    def _store(self, token: int) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[green_list(token, self.vocab_size, self.gamma)] = True
        slot = self.next_slot
        self.next_slot = (slot + 1) % len(self.token_in)
        if self.token_in[slot] >= 0:
            self.slot_of[self.token_in[slot]] = -1
        self.token_in[slot], self.slot_of[token] = token, slot
        self.masks[slot] = mask
        return mask.to(self.masks.device)


def score(token_ids: list[int], vocab_size: int, gamma: float) -> dict:
    """Green tokens among token_ids[1:] (each after its predecessor), each distinct bigram
    counted once: the count, the tokens scored, the z-score and its one-sided p-value."""
    bigrams = list(dict.fromkeys(zip(token_ids, token_ids[1:])))
    green = sum(int(token) in _green_set(previous, vocab_size, gamma)
                for previous, token in bigrams)
    scored = len(bigrams)
    if not scored:
        raise ValueError("a text of fewer than two tokens cannot be scored")
    z = (green - gamma * scored) / math.sqrt(scored * gamma * (1 - gamma))
    return {"green_tokens": green, "scored_tokens": scored, "green_fraction": green / scored,
            "z_score": z, "p_value": 0.5 * math.erfc(z / math.sqrt(2))}


def _green_set(previous: int, vocab_size: int, gamma: float) -> set[int]:
    return set(green_list(previous, vocab_size, gamma).tolist())


def detect(model: str | Path, text: str) -> dict:
    """Score `text` with a converted model's tokenizer, vocabulary width and engine.json's
    gamma (`model`: its repository entry or version directory)."""
    from transformers import AutoConfig, AutoTokenizer

    from tritonlm.config import WEIGHTS_DIR, EngineConfig
    from tritonlm.engine.llm_engine import resolve_model_dir
    model_dir = resolve_model_dir(model)
    gamma = EngineConfig.load(model_dir).watermark_gamma
    weights = model_dir / WEIGHTS_DIR
    ids = AutoTokenizer.from_pretrained(weights).encode(text, add_special_tokens=False)
    return {**score(ids, AutoConfig.from_pretrained(weights).vocab_size, gamma), "gamma": gamma}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonlm.watermark",
                                     description="Detect TGI's watermark in a text.")
    commands = parser.add_subparsers(dest="command", required=True)
    detector = commands.add_parser("detect", help="print the z-score and p-value of a text")
    detector.add_argument("--model", required=True, help="converted model dir REPO/NAME")
    detector.add_argument("text", help="the text, or a file holding it")
    args = parser.parse_args(argv)
    path = Path(args.text)
    text = path.read_text() if len(args.text) < 4096 and path.is_file() else args.text
    print(json.dumps(detect(args.model, text), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
