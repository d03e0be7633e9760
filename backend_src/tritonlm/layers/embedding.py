"""The token embedding: a float table, or quantized storage (a GGUF file's Q8_0 / Q4_0 / Q4_1
rows kept as they are, `X.quantized.*`) whose rows are decoded as they are looked up. A tied LM
head multiplies by the same storage (its fused matmul keeps its own layout beside the rows)."""
import torch
import torch.nn.functional as F
from torch import nn

from tritonlm.layers.quantization import QUANTIZED, QuantizedWeight


class VocabEmbedding(nn.Embedding):
    def use_quantized_weight(self, bits: int, num_groups: int, has_biases: bool) -> None:
        del self.weight
        storage = QuantizedWeight(self.num_embeddings, self.embedding_dim, bits, num_groups, has_biases, None)
        storage.keeps_rows = True
        self.add_module(QUANTIZED, storage)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        storage = getattr(self, QUANTIZED, None)
        if storage is None:
            return F.embedding(input_ids, self.weight)
        return storage.rows(input_ids)
