"""The models the front end serves: names from Triton's repository index, metadata (context
length, dtype, sampling defaults) from each model's config.pbtxt parameters, and, where the front
end can read the model repository, the tokenizer (for /tokenize and TGI's length checks)."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException

from tritonlm_client._core import defaults_from_parameters

from .errors import APIError
from .triton_gateway import TritonGateway

logger = logging.getLogger("tritonlm.frontend")
WEIGHTS_DIR = "weights"
MULTI_LORA_FILE = "multi_lora.json"  # a version's LoRA adapters, {"name": "path"}
# TGI serves one model and ignores the name: its docs' OpenAI examples send "tgi" and
# huggingface_hub's InferenceClient sends "dummy" for a base_url; with one model served, they
# name it (any other unknown name is a 404).
TGI_PLACEHOLDER_NAMES = frozenset({"tgi", "dummy"})
# engine.json's limits on what one request may ask for (TGI's names)
REQUEST_LIMITS = ("max_concurrent_requests", "max_best_of", "max_stop_sequences",
                  "max_top_n_tokens")


@dataclass
class ServedModel:
    name: str
    parameters: dict[str, str]
    created: int
    tokenizer: Tokenizer | None = None
    special_token_ids: frozenset[int] = frozenset()
    device_type: str = "cpu"
    chat_template: str | None = None  # what tool_choice "auto" reads the call format from
    # engine.json's per-request limits (max_best_of, ...), where the repository is readable
    limits: dict[str, int] = field(default_factory=dict)
    adapters: list[str] = field(default_factory=list)  # its LoRA adapters (multi_lora.json)

    @classmethod
    def from_config(cls, name: str, config: dict) -> "ServedModel":
        """From the model's Triton configuration: its parameters (architecture, max_model_len,
        dtype...) and its instances' device."""
        parameters = {key: value.get("string_value", "")
                      for key, value in config.get("parameters", {}).items()}
        on_gpu = any(group.get("kind") == "KIND_GPU" for group in config.get("instance_group", []))
        return cls(name, parameters, int(time.time()), device_type="cuda" if on_gpu else "cpu")

    @property
    def sampling_defaults(self) -> dict:
        """What the engine applies where a request leaves a key unset (the model's
        generation_config, written into config.pbtxt by the converter as default_<key>)."""
        return defaults_from_parameters(self.parameters)

    @property
    def max_model_len(self) -> int | None:
        value = self.parameters.get("max_model_len")
        return int(value) if value and value.isdigit() else None

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise APIError(501, f"the front end cannot read model {self.name!r}'s tokenizer: start "
                           "it with --model-repository pointing at the served repository")
        return self.tokenizer


def _version_dir(model_dir: Path) -> Path | None:
    versions = [p for p in model_dir.glob("*") if p.name.isdigit() and (p / WEIGHTS_DIR).is_dir()]
    return max(versions, key=lambda p: int(p.name)) if versions else None


def _read_files(model: ServedModel, repository: Path) -> None:
    version = _version_dir(repository / model.name)
    if version is None:
        logger.warning("model %s: no %s/ under %s; /tokenize is unavailable for it", model.name,
                       WEIGHTS_DIR, repository / model.name)
        return
    _read_adapters(model, version)
    engine = version / "engine.json"
    if engine.is_file():  # the engine's settings win over the converter's config.pbtxt values
        settings = json.loads(engine.read_text())
        if isinstance(settings.get("max_model_len"), int):
            model.parameters["max_model_len"] = str(settings["max_model_len"])
        model.limits = {name: settings[name] for name in REQUEST_LIMITS
                        if isinstance(settings.get(name), int)}
    weights = version / WEIGHTS_DIR
    model.chat_template = _chat_template(weights)
    if (weights / "tokenizer.json").is_file():
        model.tokenizer = Tokenizer.from_file(str(weights / "tokenizer.json"))
        model.special_token_ids = frozenset(
            token_id for token_id, token in model.tokenizer.get_added_tokens_decoder().items()
            if token.special)


def _read_adapters(model: ServedModel, version: Path) -> None:
    listed = version / MULTI_LORA_FILE
    try:
        names = json.loads(listed.read_text()) if listed.is_file() else {}
    except (OSError, ValueError) as exc:
        logger.warning("model %s: %s unreadable (%s); serving no adapters", model.name, listed, exc)
        names = {}
    model.adapters = [name for name in names if isinstance(name, str)]


def _chat_template(weights: Path) -> str | None:
    if (weights / "chat_template.jinja").is_file():
        return (weights / "chat_template.jinja").read_text()
    config = weights / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):  # named templates: the default one, or all of them
        template = "\n".join(t.get("template", "") for t in template)
    return template


class ModelCatalog:
    """Served models by name; a name Triton does not serve is a 404."""

    def __init__(self, gateway: TritonGateway, repository: Path | None = None):
        self.gateway = gateway
        self.repository = repository
        self.models: dict[str, ServedModel] = {}

    async def refresh(self) -> None:
        try:
            names = await self.gateway.model_names()
        except InferenceServerException as exc:
            raise APIError(503, f"tritonserver at {self.gateway.url} is unavailable: "
                           f"{exc.message()}") from None
        models = {}
        for name in names:
            model = self.models.get(name)
            if model is None:
                model = ServedModel.from_config(name, await self.gateway.model_config(name))
                if self.repository is not None:
                    _read_files(model, self.repository)
            elif self.repository is not None:  # added since (tritonlm-convert --add-lora)
                version = _version_dir(self.repository / name)
                if version is not None:
                    _read_adapters(model, version)
            models[name] = model
        self.models = models

    async def resolve(self, name: str | None) -> tuple[ServedModel, str | None]:
        """The model a client's model name means, and the LoRA adapter it names, if any (an
        adapter's name stands for its base model with that adapter, as in vLLM)."""
        if name is not None and name not in self.models and self._serving(name) is None:
            await self.refresh()  # an adapter may have been added since
        base = self._serving(name)
        return (base, name) if base is not None else (await self.get(name), None)

    def _serving(self, adapter: str | None) -> ServedModel | None:
        if adapter in self.models:
            return None
        return next((m for m in self.models.values() if adapter in m.adapters), None)

    async def get(self, name: str | None) -> ServedModel:
        """The model named `name` (None: the only, or first, served model)."""
        if (name is not None and name not in self.models) or not self.models:
            await self.refresh()  # a model may have been loaded since
        if name in TGI_PLACEHOLDER_NAMES and name not in self.models and len(self.models) == 1:
            name = None
        if name is None:
            if not self.models:
                raise APIError(503, "tritonserver serves no model yet")
            return next(iter(self.models.values()))
        if name not in self.models:
            served = ", ".join([*self.models, *(a for m in self.models.values()
                                                for a in m.adapters)]) or "none"
            raise APIError(404, f"The model `{name}` does not exist (served: {served}).", "model")
        return self.models[name]
