"""Gemma (1): Llama with (1 + weight) RMSNorms in float32 and embeddings scaled by
sqrt(hidden_size); head_dim, the gated MLP's activation and the tied head come from the config."""
import torch

from tritonlm.layers.norm import OffsetRMSNorm
from tritonlm.models.llama import LlamaForCausalLM, LlamaModel


class GemmaModel(LlamaModel):
    norm_class = OffsetRMSNorm

    def __init__(self, config, max_positions: int):
        super().__init__(config, max_positions)
        with torch.device("cpu"):  # HF's float32 constant, cast to the hidden dtype when used
            self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5),
                                 persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    decoder_class = GemmaModel
