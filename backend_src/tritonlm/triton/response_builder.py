"""Turns engine outputs into the contract's output arrays: one per delta when streaming, one
accumulated response otherwise. No Triton import."""
import json

import numpy as np

from tritonlm.engine.llm_engine import RequestOutput
from tritonlm.triton.request_parser import ParsedRequest


class ResponseBuilder:
    def __init__(self, parsed: ParsedRequest, prompt_text: str):
        self.stream = parsed.stream
        self.flags = parsed.return_flags
        # Echoing the prompt (exclude_input_in_output=false) prepends it to the first text.
        self.pending_text = "" if parsed.exclude_input_in_output else prompt_text
        self.pending_tokens: list[int] = []
        self.pending_logprobs: list[dict] = []

    def on_output(self, out: RequestOutput) -> dict[str, np.ndarray] | None:
        """Output arrays to send now, or None while a non-streaming request is still running."""
        self.pending_text += out.text
        self.pending_tokens += out.token_ids
        self.pending_logprobs += out.logprobs or []
        if not (self.stream or out.finished):
            return None
        arrays = {"text_output": np.array([self.pending_text.encode("utf-8")], dtype=np.object_)}
        if "return_token_ids" in self.flags:
            arrays["token_ids"] = np.array(self.pending_tokens, dtype=np.int64)
        if "return_finish_reason" in self.flags:
            reasons = [out.finish_reason.encode()] if out.finished and out.finish_reason else []
            arrays["finish_reason"] = np.array(reasons, dtype=np.object_)
        if "return_num_input_tokens" in self.flags:
            arrays["num_input_tokens"] = np.array([out.num_prompt_tokens], dtype=np.uint32)
        if "return_num_output_tokens" in self.flags:
            arrays["num_output_tokens"] = np.array([len(self.pending_tokens)], dtype=np.uint32)
        if "return_cumulative_logprob" in self.flags:
            arrays["cumulative_logprob"] = np.array([out.cumulative_logprob], dtype=np.float32)
        if "return_logprobs" in self.flags:
            arrays["logprobs"] = np.array([json.dumps(e).encode() for e in self.pending_logprobs],
                                          dtype=np.object_)
        self.pending_text, self.pending_tokens, self.pending_logprobs = "", [], []
        return arrays
