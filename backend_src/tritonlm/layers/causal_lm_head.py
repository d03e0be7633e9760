"""The wrapper of families that keep their decoder under `transformer` (Falcon, BLOOM, MPT):
the output projection is its own `lm_head`, or the input embedding when the config ties them."""
import torch
import torch.nn.functional as F
from torch import nn

from tritonlm.layers.attention_metadata import AttentionMetadata


class TransformerCausalLM(nn.Module):
    """`transformer` must have `input_embeddings()` returning its token embedding."""

    def __init__(self, config, transformer: nn.Module):
        super().__init__()
        self.transformer = transformer
        self.tie_word_embeddings = config.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.transformer.input_embeddings() if self.tie_word_embeddings else self.lm_head
        return F.linear(hidden, head.weight)
