"""A draft model's greedy head through a shortlist. A draft step reads the whole head for one
argmax a row: SmolLM2's 49,152 x 576 head held as int8 was 0.8 ms of a 3.8 ms draft step on Zen 4.
Here a 4-bit copy of the head (groups of 128: 0.53 bytes a weight against int8's 1) ranks the
vocabulary, and the float head's rows of the SHORTLIST best (as many dot products) pick the token:
the float head's argmax wherever it ranks among them, which it did for every one of 917 rows of
SmolLM2 chats (8 were enough). Not exact in general, so for drafts only: the target's
verification keeps exactly the tokens it would have drawn, whatever a draft proposes. (FR-Spec,
Zhao et al. 2025, shortlists a draft's vocabulary by token frequency instead.)"""
import torch

from tritonlm.layers import cpu_kernels, quantized_matmul
from tritonlm.layers.quantization import QUANTIZED, quantize_int4, unpack_int4

SHORTLIST = 16
GROUP_SIZE = 128


class ShortlistHead:
    """`head(hidden [S, hidden_size]) -> tokens [S]`: the greedy tokens of a float head `weight`
    [vocab, hidden_size] (the model's dtype) through its 4-bit shortlist."""

    def __init__(self, weight: torch.Tensor, kernels, int8_inputs: bool):
        storage = quantize_int4(weight, GROUP_SIZE)
        self.rank = quantized_matmul.cpu_matmul(
            storage["qweight"], lambda: unpack_int4(storage["qweight"]), storage["scales"],
            storage["biases"], storage["g_idx"], weight.dtype, int8_inputs)
        self.weight = weight.contiguous()
        self.kernels = kernels

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernels.shortlist_argmax(self.rank(hidden), hidden, self.weight, SHORTLIST)


def shortlist_head(model, dtype: torch.dtype, int8_inputs: bool) -> ShortlistHead | None:
    """The shortlist of `model`'s head (on the CPU, in `dtype`) where the C++ kernels multiply
    4-bit weights for that dtype and the head is larger than its shortlist (float or int8, not
    4-bit already); None elsewhere."""
    kernels = cpu_kernels.load()
    if (kernels is None or not kernels.has_bf16_matmul
            or dtype not in (torch.float32, torch.bfloat16)):
        return None
    weight = _float_head(model, dtype)
    if weight is None or weight.device.type != "cpu" or weight.shape[1] % 2:
        return None
    return ShortlistHead(weight, kernels, int8_inputs)


def _float_head(model, dtype: torch.dtype) -> torch.Tensor | None:
    """The head's weight in `dtype`: a float head's, a tied float embedding's beside an int8
    copy of it, or int8 storage dequantized; None for a 4-bit head."""
    head = model.output_head()
    quantized = getattr(head, QUANTIZED, None)
    if quantized is None:
        return head.weight.to(dtype)
    if quantized.qweight.dtype == torch.uint8:
        return None
    embedding = model.input_embeddings()
    if model.tie_word_embeddings and getattr(embedding, QUANTIZED, None) is None:
        return embedding.weight.to(dtype)
    return quantized(dtype)
