"""The canonical config.json written next to the weights."""
from transformers import AutoConfig, PretrainedConfig

from .errors import ConversionError


def source_dtype(raw: dict) -> str | None:
    """The dtype a config.json says its weights are stored in (`torch_dtype`, or `dtype` since transformers 5)."""
    return raw.get("torch_dtype") or raw.get("dtype")


def resolve_config(raw: dict) -> PretrainedConfig:
    """transformers' config object for `raw`, defaults filled in; ConversionError if it is invalid."""
    values = {k: v for k, v in raw.items() if k not in ("model_type", "dtype", "torch_dtype")}
    try:
        return AutoConfig.for_model(raw.get("model_type"), **values)
    except (KeyError, ValueError, TypeError) as e:
        raise ConversionError(f"invalid config.json: {e}") from None


def canonical_config(resolved: PretrainedConfig, dtype: str) -> dict:
    """Every field of the resolved config written out, so the engine never relies on defaults."""
    config = resolved.to_dict()
    config.pop("dtype", None)
    rope = dict(getattr(resolved, "rope_parameters", None) or {})
    if "rope_theta" in rope:  # transformers 5 folds rope_theta and rope_scaling in; write both spellings
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    config["torch_dtype"] = dtype
    return config
