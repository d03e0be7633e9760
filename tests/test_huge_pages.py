"""The CPU KV cache is allocated on transparent huge pages where the kernel offers them."""
from pathlib import Path

import pytest
import torch

from tritonlm.layers import huge_pages
from tritonlm.layers.kv_cache import KVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_bytes_backing(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings of /proc/self/smaps that overlap the tensor's memory."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: lo-hi perms ...
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            overlaps = lo < end and start < hi
        elif overlaps and fields[0] == "AnonHugePages:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.parametrize("shape", [(3, 5, 7), (0, 4), (1 << 20, 3)])
def test_empty_is_zeroed_with_the_asked_shape(shape):
    tensor = huge_pages.empty(shape, torch.bfloat16)
    assert tensor.shape == shape and tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, torch.zeros_like(tensor))
    tensor.fill_(1)  # writable, and its memory outlives this function's mapping object
    assert float(tensor.float().sum()) == tensor.numel()


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are off on this machine")
def test_kv_cache_lies_on_huge_pages():
    cache = KVCache(2, 1024, (3, 16, 64), torch.bfloat16, False, torch.device("cpu"))  # 24 MiB
    assert huge_bytes_backing(cache.values) >= 8 * huge_pages.HUGE_PAGE
