"""The causal-LM wrapper of every decoder-only family. Subclasses name the checkpoint's modules:
the decoder (`model`, `transformer`, `gpt_neox`), its token embedding inside it, and the output
head (`lm_head`, NeoX's `embed_out`), which is the embedding itself when the config ties them,
unless the checkpoint holds the head as quantized storage (`lm_head.quantized.*`, written by
tritonlm-convert beside a tied embedding, which the input side keeps)."""
import torch
import torch.nn.functional as F
from torch import nn

from tritonlm.layers import cpu_gemm
from tritonlm.layers.attention_metadata import AttentionMetadata
from tritonlm.layers.linear import ReplicatedLinear
from tritonlm.layers.quantization import QUANTIZED


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

    def head_parameter(self) -> str:
        """The parameter the output head multiplies by: the head's, or the tied embedding's."""
        if self.tie_word_embeddings:
            return f"{self.decoder_name}.{self.embedding_name}.weight"
        return f"{self.head_name}.weight"

    def use_quantized_head(self) -> None:
        """Make the head a linear layer that takes quantized storage (the loader gives it)."""
        embedding = self.input_embeddings()
        setattr(self, self.head_name, ReplicatedLinear(embedding.embedding_dim,
                                                       embedding.num_embeddings, bias=False))

    def output_head(self) -> nn.Module:
        head = getattr(self, self.head_name, None)
        return head if head is not None else self.input_embeddings()

    def prepack_for_cpu(self, batch_hint: int) -> None:
        """A copy of the head weight in a CPU matmul kernel's layout, when that is faster here
        (kept beside the embedding when tied); quantized storage packs itself."""
        head = self.output_head()
        if getattr(head, QUANTIZED, None) is None:
            self.packed_head = cpu_gemm.prepack(head.weight, batch_hint)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        packed = getattr(self, "packed_head", None)
        if packed is not None:
            return packed.matmul(hidden, None)
        head = self.output_head()
        quantized = getattr(head, QUANTIZED, None)
        if quantized is not None:
            return quantized.matmul(hidden, None)
        return F.linear(hidden, head.weight)
