"""How a runner's attention layers run: flash-attn, the kernels that read the paged cache in place,
or PyTorch; and the KV cache slices they read (layers with one kv_slot share one)."""
import torch

from tritonlm.layers import cpu_kernels, triton_paged_attention, triton_support
from tritonlm.layers.attention import (PagedAttention, PagedKernels, cache_block_shape,
                                       flash_attention_usable)
from tritonlm.layers.kv_cache import KVCache


def biases_known(layers: list[PagedAttention]) -> bool:
    """Whether every layer's position bias is one flash-attn and the paged kernels know: none, or
    ALiBi (not T5's relative buckets)."""
    return all(layer.position_bias is None or hasattr(layer.position_bias, "slopes")
               for layer in layers)


def flash_usable(layers: list[PagedAttention], device: torch.device, dtype: torch.dtype,
                 block_size: int, kv_cache_dtype: str) -> bool:
    return (flash_attention_usable(device, dtype, block_size, kv_cache_dtype)
            and biases_known(layers))


def paged_kernels(layers: list[PagedAttention], device: torch.device, use_flash: bool,
                  kv_cache_dtype: str) -> PagedKernels:
    """The kernels that read the paged cache in place, where they can run every layer: they read
    a 16- or 32-bit cache and know ALiBi, not T5's relative buckets. On CPU the C++ decode and
    prefill kernels; on CUDA without flash-attn the Triton decode kernel."""
    if use_flash or kv_cache_dtype != "auto" or not biases_known(layers):
        return PagedKernels()
    if device.type == "cuda" and triton_support.available(device):
        return PagedKernels(decode=triton_paged_attention.decode_attention)
    module = cpu_kernels.load() if device.type == "cpu" else None
    if module is None:
        return PagedKernels()
    return PagedKernels(module.decode_attention, module.prefill_attention)


class CacheSlots:
    """The KV cache's layout over `layers`: one slice per kv_slot (or per layer without one), each
    block of `block_shape` in the layout the layers' attention reads."""

    def __init__(self, layers: list[PagedAttention], block_size: int, dtype: torch.dtype,
                 int8: bool, use_flash: bool, device: torch.device):
        self.layers, self.dtype, self.int8, self.device = layers, dtype, int8, device
        self.use_flash = use_flash
        first = layers[0]
        self.block_shape = cache_block_shape(block_size, first.num_kv_heads, first.head_dim,
                                             use_flash)
        self.slots = {}  # kv_slot (or the layer itself) -> index of its cache slice
        for layer in layers:
            self.slots.setdefault(self._key(layer), len(self.slots))

    @staticmethod
    def _key(layer: PagedAttention):
        return layer if layer.kv_slot is None else layer.kv_slot

    def bytes_per_block(self) -> int:
        return KVCache.bytes_per_block(len(self.slots), self.block_shape, self.dtype, self.int8)

    def allocate(self, num_blocks: int) -> KVCache:
        return KVCache(len(self.slots), num_blocks, self.block_shape, self.dtype, self.int8,
                       self.device)

    def attach(self, cache: KVCache | None) -> None:
        """Every layer reads and writes its slice of `cache` (None: no cache)."""
        for layer in self.layers:
            layer.kv = None if cache is None else cache.layer(self.slots[self._key(layer)])
            layer.use_flash = self.use_flash
