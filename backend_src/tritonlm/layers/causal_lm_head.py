"""The causal-LM wrapper of every decoder-only family. Subclasses name the checkpoint's modules:
the decoder (`model`, `transformer`, `gpt_neox`), its token embedding inside it, and the output
head (`lm_head`, NeoX's `embed_out`), which is the embedding itself when the config ties them."""
import torch
import torch.nn.functional as F
from torch import nn

from tritonlm.layers import cpu_gemm
from tritonlm.layers.attention_metadata import AttentionMetadata


class CausalLM(nn.Module):
    decoder_class: type[nn.Module]  # built as decoder_class(config, max_positions)
    decoder_name = "model"
    embedding_name = "embed_tokens"  # a path inside the decoder
    head_name = "lm_head"

    def __init__(self, config, max_positions: int):
        super().__init__()
        setattr(self, self.decoder_name, self.decoder_class(config, max_positions))
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        if not self.tie_word_embeddings:
            embedding = self.input_embeddings()  # the head maps back to the embedding's space
            setattr(self, self.head_name, nn.Linear(embedding.embedding_dim,
                                                    embedding.num_embeddings, bias=False))

    @property
    def decoder(self) -> nn.Module:
        return getattr(self, self.decoder_name)

    def input_embeddings(self) -> nn.Embedding:
        return self.decoder.get_submodule(self.embedding_name)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.decoder(input_ids, positions, meta)

    def output_head(self) -> nn.Module:
        return self.input_embeddings() if self.tie_word_embeddings else getattr(self, self.head_name)

    def prepack_for_cpu(self, batch_hint: int) -> None:
        """A copy of the head weight in a CPU matmul kernel's layout, when that is faster here
        (kept beside the embedding when tied)."""
        self.packed_head = cpu_gemm.prepack(self.output_head().weight, batch_hint)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        packed = getattr(self, "packed_head", None)
        if packed is not None:
            return packed.matmul(hidden, None)
        return F.linear(hidden, self.output_head().weight)
