"""Turns engine outputs into the contract's output arrays, one response per output: the engine
sends a streamed request's deltas as they come and a request that does not stream one output at
its end. A request with n sequences gets n entries in text_output, finish_reason,
num_output_tokens and cumulative_logprob (index order); its token_ids and logprobs are the
sequences' entries one after another, num_output_tokens long each. A request that set
prompt_logprobs gets them (JSON per prompt token) on its first response. No Triton import."""
import json

import numpy as np

from tritonlm.engine.request_state import RequestOutput
from tritonlm.triton.request_parser import ParsedRequest


class ResponseBuilder:
    def __init__(self, parsed: ParsedRequest, prompt_text: str):
        self.flags = parsed.return_flags
        self.prompt_logprobs = parsed.params.prompt_logprobs is not None
        # Echoing the prompt (exclude_input_in_output=false) prepends it to the first text.
        self.echo = "" if parsed.exclude_input_in_output else prompt_text

    def on_output(self, out: RequestOutput) -> dict[str, np.ndarray]:
        """The output arrays of the response for `out`."""
        echo, self.echo = self.echo, ""
        seqs = out.sequences
        arrays = {"text_output": np.array([(echo + s.text).encode("utf-8") for s in seqs],
                                          dtype=np.object_)}
        if "return_token_ids" in self.flags:
            arrays["token_ids"] = np.array([t for s in seqs for t in s.token_ids], dtype=np.int64)
        if "return_finish_reason" in self.flags:
            reasons = [(s.finish_reason or "").encode() for s in seqs] if out.finished else []
            arrays["finish_reason"] = np.array(reasons, dtype=np.object_)
        if "return_stop_reason" in self.flags:
            reasons = [json.dumps(s.stop_reason).encode() for s in seqs] if out.finished else []
            arrays["stop_reason"] = np.array(reasons, dtype=np.object_)
        if "return_num_input_tokens" in self.flags:
            arrays["num_input_tokens"] = np.array([out.num_prompt_tokens], dtype=np.uint32)
        if "return_num_output_tokens" in self.flags:
            arrays["num_output_tokens"] = np.array([len(s.token_ids) for s in seqs],
                                                   dtype=np.uint32)
        if "return_cumulative_logprob" in self.flags:
            arrays["cumulative_logprob"] = np.array([s.cumulative_logprob for s in seqs],
                                                    dtype=np.float32)
        if "return_logprobs" in self.flags:
            arrays["logprobs"] = np.array([json.dumps(e).encode() for s in seqs
                                           for e in s.logprobs or []], dtype=np.object_)
        if self.prompt_logprobs:
            arrays["prompt_logprobs"] = np.array(
                [json.dumps(e).encode() for e in out.prompt_logprobs or []], dtype=np.object_)
        return arrays
