"""The canonical config.json written next to the weights."""
from transformers import AutoConfig

from .architectures import Architecture
from .errors import ConversionError


def source_dtype(raw: dict) -> str | None:
    """The dtype a config.json says its weights are stored in (`torch_dtype`, or `dtype` since transformers 5)."""
    return raw.get("torch_dtype") or raw.get("dtype")


def canonical_config(raw: dict, arch: Architecture, dtype: str) -> dict:
    """`raw` with every field the engine reads made explicit, transformers' defaults filled in."""
    values = {k: v for k, v in raw.items() if k not in ("model_type", "dtype", "torch_dtype")}
    try:
        resolved = AutoConfig.for_model(raw.get("model_type"), **values)
    except (KeyError, ValueError, TypeError) as e:
        raise ConversionError(f"invalid config.json: {e}") from None
    config = {k: v for k, v in raw.items() if k != "dtype"}
    config.update({k: getattr(resolved, k) for k in arch.config_fields})
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters; write both spellings.
    rope = dict(resolved.rope_parameters or {})
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    config["torch_dtype"] = dtype
    return config
