"""Turns engine outputs into the contract's output arrays: one per step when streaming, one
accumulated response otherwise. A request with n sequences gets n entries in text_output,
finish_reason, num_output_tokens and cumulative_logprob (index order); its token_ids and logprobs
are the sequences' entries one after another, num_output_tokens long each. No Triton import."""
import json

import numpy as np

from tritonlm.engine.request_state import RequestOutput
from tritonlm.triton.request_parser import ParsedRequest


class _Pending:
    def __init__(self, text: str):
        self.text = text
        self.tokens: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason = ""
        self.cumulative_logprob = 0.0


class ResponseBuilder:
    def __init__(self, parsed: ParsedRequest, prompt_text: str):
        self.stream = parsed.stream
        self.flags = parsed.return_flags
        # Echoing the prompt (exclude_input_in_output=false) prepends it to the first text.
        self.echo = "" if parsed.exclude_input_in_output else prompt_text
        self.pending = [_Pending(self.echo) for _ in range(parsed.params.n)]

    def on_output(self, out: RequestOutput) -> dict[str, np.ndarray] | None:
        """Output arrays to send now, or None while a non-streaming request is still running."""
        for delta in out.sequences:
            pending = self.pending[delta.index]
            pending.text += delta.text
            pending.tokens += delta.token_ids
            pending.logprobs += delta.logprobs or []
            pending.finish_reason = delta.finish_reason or ""
            pending.cumulative_logprob = delta.cumulative_logprob
        if not (self.stream or out.finished):
            return None
        sent, self.pending = self.pending, [_Pending("") for _ in self.pending]
        arrays = {"text_output": np.array([p.text.encode("utf-8") for p in sent], dtype=np.object_)}
        if "return_token_ids" in self.flags:
            arrays["token_ids"] = np.array([t for p in sent for t in p.tokens], dtype=np.int64)
        if "return_finish_reason" in self.flags:
            reasons = [p.finish_reason.encode() for p in sent] if out.finished else []
            arrays["finish_reason"] = np.array(reasons, dtype=np.object_)
        if "return_num_input_tokens" in self.flags:
            arrays["num_input_tokens"] = np.array([out.num_prompt_tokens], dtype=np.uint32)
        if "return_num_output_tokens" in self.flags:
            arrays["num_output_tokens"] = np.array([len(p.tokens) for p in sent], dtype=np.uint32)
        if "return_cumulative_logprob" in self.flags:
            arrays["cumulative_logprob"] = np.array([p.cumulative_logprob for p in sent],
                                                    dtype=np.float32)
        if "return_logprobs" in self.flags:
            arrays["logprobs"] = np.array([json.dumps(e).encode() for p in sent for e in p.logprobs],
                                          dtype=np.object_)
        return arrays
