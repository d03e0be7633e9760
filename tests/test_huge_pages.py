"""The CPU KV cache and the packed matmul weights lie on transparent huge pages where the kernel
offers them."""
import gc
from pathlib import Path

import pytest
import torch

from tritonlm.layers import cpu_kernels, huge_pages
from tritonlm.layers.cpu_gemm import PairBlockWeight
from tritonlm.layers.kv_cache import KVCache
from tritonlm.layers.quantized_matmul import PairBlocks

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


def mapped(address: int) -> bool:
    """Whether a mapping of /proc/self/maps holds the address."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return True
    return False


@pytest.fixture
def fresh_regions(monkeypatch):
    """place fills a region of the test's own, not one that earlier tests left half full."""
    monkeypatch.setattr(huge_pages, "_regions", huge_pages._Regions())


@pytest.mark.parametrize("shape", [(3, 5, 7), (0, 4), (1 << 20, 3)])
def test_empty_is_zeroed_with_the_asked_shape(shape):
    tensor = huge_pages.empty(shape, torch.bfloat16)
    assert tensor.shape == shape and tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, torch.zeros_like(tensor))
    tensor.fill_(1)  # writable, and its memory outlives this function's mapping object
    assert float(tensor.float().sum()) == tensor.numel()


THP_OFF = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                             reason="transparent huge pages are off on this machine")


@THP_OFF
def test_kv_cache_lies_on_huge_pages():
    cache = KVCache(2, 1024, (3, 16, 64), torch.bfloat16, False, torch.device("cpu"))  # 24 MiB
    assert huge_bytes_backing(cache.values) >= 8 * huge_pages.HUGE_PAGE


def test_placed_tensors_keep_their_values_one_after_another(fresh_regions):
    strided = torch.randn(300, 7).T  # not contiguous
    tensors = [torch.arange(1000, dtype=torch.int64), strided,
               torch.randint(0, 255, (3, 5), dtype=torch.uint8), torch.zeros(0)]
    placed = [huge_pages.place(t) for t in tensors]
    for original, copy in zip(tensors, placed):
        assert torch.equal(original, copy) and copy.dtype == original.dtype
        assert copy.is_contiguous()
    assert placed[0].data_ptr() % huge_pages.HUGE_PAGE == 0  # the region's start
    assert placed[1].data_ptr() == placed[0].data_ptr() + 8000  # the next cache line
    assert placed[2].data_ptr() == -(-(placed[1].data_ptr() + 2100 * 4) // 64) * 64
    placed[1].fill_(3)  # a copy: the original is untouched
    assert not torch.equal(tensors[1], placed[1])


def test_a_tensor_larger_than_a_region_gets_a_mapping_of_its_own(fresh_regions):
    before = huge_pages.place(torch.ones(100, dtype=torch.uint8))
    big = huge_pages.place(torch.ones(huge_pages.REGION + 1, dtype=torch.uint8))
    after = huge_pages.place(torch.ones(100, dtype=torch.uint8))
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0 and int(big.sum()) == huge_pages.REGION + 1
    assert after.data_ptr() == before.data_ptr() + 128  # the region in use goes on
    address = big.data_ptr()
    del big
    gc.collect()
    assert not mapped(address)  # its memory went back with it


def test_a_region_goes_back_once_nothing_placed_in_it_lives():
    regions = huge_pages._Regions()
    first, second = regions.take(1000), regions.take(5000)
    address = first.data_ptr()
    del first, regions
    gc.collect()
    assert mapped(address)  # second still lives
    del second
    gc.collect()
    assert not mapped(address)


@THP_OFF
@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels are not built here")
def test_packed_weights_lie_on_huge_pages(fresh_regions):
    kernels = cpu_kernels.load()
    values = torch.randint(0, 16, (8192, 1024), dtype=torch.uint8)
    int4 = PairBlocks(values, torch.rand(8192, 32), torch.rand(8192, 32), torch.arange(1024) // 32,
                      32, kernels)  # 4 MiB of values, 2 MiB of group scales and biases
    assert huge_bytes_backing(int4.packed) >= 2 * huge_pages.HUGE_PAGE
    assert huge_bytes_backing(int4.groups) >= 2 * huge_pages.HUGE_PAGE  # their shared region
    bf16 = PairBlockWeight(torch.randn(4096, 1024, dtype=torch.bfloat16), kernels)  # 8 MiB
    assert huge_bytes_backing(bf16.data) >= 3 * huge_pages.HUGE_PAGE
