"""The settings a chat starts from (the chat CLI and the front end's chat page share them): the
model's own sampling defaults where its generation_config gives them, else CHAT_DEFAULTS."""
from __future__ import annotations

from typing import Any, Mapping

# Chat settings for a model that gives none. An untuned sampler (temperature 1.0, no top-k/top-p)
# makes small models ramble; these are the values llama.cpp's server and LMDeploy's chat start
# from: temperature 0.7 with top_p 0.9 and top_k 40 cut the long tail of unlikely tokens while
# keeping replies varied, a mild repetition_penalty of 1.1 (transformers' semantics) stops the
# loops small models fall into, and 512 new tokens bound a reply without cutting a normal answer.
CHAT_DEFAULTS: dict[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "repetition_penalty": 1.1,
    "max_tokens": 512,
}


def chat_settings(model_defaults: Mapping[str, Any]) -> dict[str, Any]:
    """CHAT_DEFAULTS overridden by the model's own values (its generation_config's sampling keys,
    e.g. ServedModel.sampling_defaults); keys the model sets that CHAT_DEFAULTS lacks (min_p) are
    kept too."""
    return {**CHAT_DEFAULTS, **{k: v for k, v in model_defaults.items() if v is not None}}
