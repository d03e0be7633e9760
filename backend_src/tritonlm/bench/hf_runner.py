"""HF transformers `generate` on the same requests, one request at a time, holding the same
converted weights; a streamer takes each token's time."""
import time
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from tritonlm.bench.metrics import RequestRecord
from tritonlm.bench.workloads import BenchRequest
from tritonlm.config import WEIGHTS_DIR
from tritonlm.engine.llm_engine import resolve_model_dir


def load_hf_model(model_dir: Path, dtype: str):
    """transformers' own implementation of the converted model (tensor-parallel size 1)."""
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


class _TokenClock(BaseStreamer):
    """`generate` calls put() with the prompt first, then with each new token."""

    def __init__(self, record: RequestRecord):
        self.record, self.prompt_seen = record, False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.record.add_tokens(value.numel(), time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def run_hf(model, requests: list[BenchRequest], on_done=lambda: None
           ) -> tuple[list[RequestRecord], float]:
    model.generate(torch.tensor([requests[0].prompt_token_ids[:8]]), max_new_tokens=2,
                   do_sample=False, pad_token_id=0)  # warm-up
    records = []
    start = time.perf_counter()
    for request in requests:
        record = RequestRecord(len(request.prompt_token_ids), time.perf_counter())
        prompt = torch.tensor([request.prompt_token_ids])
        with torch.inference_mode():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                           max_new_tokens=request.output_len, min_new_tokens=request.output_len,
                           pad_token_id=0, streamer=_TokenClock(record))
        records.append(record)
        on_done()
    return records, time.perf_counter() - start
