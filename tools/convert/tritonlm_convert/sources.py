"""The interface every model source (Hugging Face directory, GGUF file) implements."""
from abc import ABC, abstractmethod

import torch
from transformers import PreTrainedTokenizerBase

from .architectures import Shapes


class Source(ABC):
    """A model to convert: its config, tensors under Hugging Face names, and tokenizer."""

    raw_config: dict  # config.json contents before canonicalization
    stored_dtype: str | None  # the dtype of the stored weights, None when they are quantized
    quantization = "none"  # how the weights are quantized, as config.pbtxt reports it

    @abstractmethod
    def tensor_shapes(self) -> Shapes:
        """Every tensor the source holds, by Hugging Face name, in storage order."""

    @abstractmethod
    def load(self, name: str) -> torch.Tensor:
        """One tensor by Hugging Face name, in the layout Hugging Face models use."""

    def tensor_dtype(self, name: str) -> torch.dtype | None:
        """The dtype a tensor is written in; None: a float tensor cast to the model dtype."""
        return None

    @abstractmethod
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer, chat template included."""

    def generation_config(self) -> dict:
        """generation_config.json contents: the special token ids generation starts and stops on."""
        return {k: self.raw_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                if self.raw_config.get(k) is not None}
