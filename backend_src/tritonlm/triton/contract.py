"""The tensor contract of the served model (shared/design/triton-io.md).

One table serves the converter (which writes config.pbtxt from it) and the adapter (which reads
requests by it), so the two cannot drift apart. No Triton import here.
"""
import json
from dataclasses import dataclass


# Set by tritonlm-serve when the server runs with --model-control-mode=explicit, the only mode in
# which a model can unload itself (and so report not ready).
EXPLICIT_CONTROL_VARIABLE = "TRITONLM_EXPLICIT_MODEL_CONTROL"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # config.pbtxt spelling without the TYPE_ prefix
    dims: tuple[int, ...]


# Scalar sampling keys that may also arrive as individual tensors (not `logprobs` and
# `prompt_logprobs`, which name outputs; they come in sampling_parameters or as request
# parameters; `logit_bias`, a JSON object, only in sampling_parameters).
SAMPLING_TENSORS = (
    TensorSpec("max_tokens", "INT32", (1,)),
    TensorSpec("min_tokens", "INT32", (1,)),
    TensorSpec("temperature", "FP32", (1,)),
    TensorSpec("top_k", "INT32", (1,)),
    TensorSpec("top_p", "FP32", (1,)),
    TensorSpec("min_p", "FP32", (1,)),
    TensorSpec("typical_p", "FP32", (1,)),
    TensorSpec("repetition_penalty", "FP32", (1,)),
    TensorSpec("presence_penalty", "FP32", (1,)),
    TensorSpec("frequency_penalty", "FP32", (1,)),
    TensorSpec("seed", "INT64", (1,)),
    TensorSpec("ignore_eos", "BOOL", (1,)),
    TensorSpec("include_stop_str_in_output", "BOOL", (1,)),
    TensorSpec("skip_special_tokens", "BOOL", (1,)),
    TensorSpec("stop", "STRING", (-1,)),
    TensorSpec("stop_token_ids", "INT64", (-1,)),
    TensorSpec("bad_words", "STRING", (-1,)),
    TensorSpec("truncate_prompt_tokens", "INT32", (1,)),
    # TensorRT-LLM's names (request_parser maps them)
    TensorSpec("stop_words", "STRING", (-1,)),
    TensorSpec("end_id", "INT32", (1,)),
    TensorSpec("random_seed", "INT64", (1,)),
    TensorSpec("min_length", "INT32", (1,)),
    TensorSpec("beam_width", "INT32", (1,)),
)

RETURN_FLAGS = (
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_token_ids",
    "return_logprobs",
    "return_cumulative_logprob",
    "return_stop_reason",
)

INPUTS = (
    TensorSpec("text_input", "STRING", (1,)),
    TensorSpec("input_ids", "INT64", (-1,)),
    TensorSpec("messages", "STRING", (1,)),
    TensorSpec("add_generation_prompt", "BOOL", (1,)),  # with messages; default true
    TensorSpec("chat_template_kwargs", "STRING", (1,)),  # with messages: a JSON object
    TensorSpec("stream", "BOOL", (1,)),
    TensorSpec("sampling_parameters", "STRING", (1,)),
    TensorSpec("exclude_input_in_output", "BOOL", (1,)),
    *(TensorSpec(flag, "BOOL", (1,)) for flag in RETURN_FLAGS),
    *SAMPLING_TENSORS,
)

OUTPUTS = (
    TensorSpec("text_output", "STRING", (-1,)),
    TensorSpec("token_ids", "INT64", (-1,)),
    TensorSpec("finish_reason", "STRING", (-1,)),
    TensorSpec("num_input_tokens", "UINT32", (1,)),
    TensorSpec("num_output_tokens", "UINT32", (-1,)),
    TensorSpec("cumulative_logprob", "FP32", (-1,)),
    TensorSpec("logprobs", "STRING", (-1,)),
    TensorSpec("stop_reason", "STRING", (-1,)),  # JSON per sequence: null, a string or a token id
    TensorSpec("prompt_logprobs", "STRING", (-1,)),  # JSON per prompt token, first response only
)


def _tensor_block(spec: TensorSpec, optional: bool) -> str:
    dims = ", ".join(str(d) for d in spec.dims)
    lines = [f'    name: "{spec.name}"', f"    data_type: TYPE_{spec.data_type}", f"    dims: [ {dims} ]"]
    if optional:
        lines.append("    optional: true")
    return "  {\n" + "\n".join(lines) + "\n  }"


def render_config_pbtxt(name: str, instance_kind: str, parameters: dict[str, str]) -> str:
    """config.pbtxt for a decoupled Python-backend model serving this contract."""
    inputs = ",\n".join(_tensor_block(s, optional=True) for s in INPUTS)
    outputs = ",\n".join(_tensor_block(s, optional=False) for s in OUTPUTS)
    # json.dumps quotes a value as protobuf text format does (backslash escapes)
    params = "\n".join(
        f'parameters {{\n  key: "{key}"\n  value: {{ string_value: {json.dumps(value)} }}\n}}'
        for key, value in sorted(parameters.items())
    )
    return (
        f'name: "{name}"\n'
        'backend: "python"\n'
        "max_batch_size: 0\n"
        "model_transaction_policy {\n  decoupled: true\n}\n"
        f"input [\n{inputs}\n]\n"
        f"output [\n{outputs}\n]\n"
        f"instance_group [\n  {{\n    count: 1\n    kind: {instance_kind}\n  }}\n]\n"
        f"{params}\n"
    )
