"""The model's generation_config.json: its stop tokens and the sampling settings it recommends,
used where a request leaves a key unset (vLLM's --generation-config auto)."""
import json
import logging
from pathlib import Path

from tritonlm.errors import InvalidRequestError
from tritonlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json key -> sampling key
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                  "max_new_tokens": "max_tokens"}


def read_generation_config(weights_dir: Path) -> dict:
    path = weights_dir / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def sampling_defaults(generation_config: dict) -> dict:
    """The sampling keys the config sets, each valid on its own (an invalid one is logged and
    left out)."""
    defaults = {}
    for name, key in _SAMPLING_KEYS.items():
        value = generation_config.get(name)
        if value is None:
            continue
        try:
            SamplingParams.from_dict({key: value})
        except InvalidRequestError as exc:
            logger.warning("ignoring generation_config.json's %s: %s", name, exc)
            continue
        defaults[key] = value
    return defaults
