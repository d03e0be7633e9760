"""Files that lie: GGUF and safetensors headers whose counts, lengths, shapes, offsets or types
do not match the file are refused with an error naming the file, never a crash or an allocation
the size of the lie (tracemalloc sees numpy's and Python's allocations)."""
import json
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from tritonlm import LLM, SamplingParams
from tritonlm_convert.errors import ConversionError
from tritonlm_convert.gguf_source import GGUFSource
from tritonlm_convert.hf_source import HFSource

HUGE = 2**62
# Far above what reading these small files needs, far below what any lie here asks for.
ALLOCATION_LIMIT = 64 * 2**20


def tiny_gguf(path: Path) -> Path:
    writer = GGUFWriter(path, "llama")
    writer.add_string("general.name", "liar")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c", "d"])
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _after_string(data: bytes, text: str) -> int:
    """The offset just after a GGUF string (u64 length, then bytes) holding `text`."""
    encoded = text.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def gguf_lies(data: bytes) -> dict[str, tuple[int, str, int] | None]:
    """Where each lie goes: (offset, struct format, value); None: the file is cut in half."""
    info = _after_string(data, "token_embd.weight")  # then n_dims u32, dims u64 x2, type, offset
    tokens = _after_string(data, "tokenizer.ggml.tokens")  # then type u32, item type u32, count
    return {
        "tensor count": (8, "<Q", HUGE),
        "metadata count": (16, "<Q", HUGE),
        "key length": (24, "<Q", HUGE),
        "array length": (tokens + 8, "<Q", HUGE),
        "dimension count": (info, "<I", 2**31),
        "dimension": (info + 4, "<Q", 2**40),
        "tensor type": (info + 4 + 16, "<I", 999),
        "tensor offset": (info + 4 + 16 + 4, "<Q", HUGE),
        "truncated": None,
    }


def lie(path: Path, data: bytes, where) -> None:
    if where is None:
        path.write_bytes(data[: len(data) // 2])
        return
    offset, fmt, value = where
    path.write_bytes(data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt):])


def refused_within_bounded_memory(open_file, path: Path, expected) -> str:
    tracemalloc.start()
    try:
        with pytest.raises(expected) as caught:
            open_file(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < ALLOCATION_LIMIT, f"{peak / 2**20:.0f} MiB allocated"
    assert str(path) in str(caught.value)
    return str(caught.value)


def test_the_unaltered_gguf_reads(tmp_path):
    """The file the lies are made from is itself readable, so each refusal is the lie's."""
    reader = GGUFReader(tiny_gguf(tmp_path / "tiny.gguf"))
    assert [t.name for t in reader.tensors] == ["token_embd.weight", "output_norm.weight"]
    assert reader.tensors[0].data.tolist()[1] == list(range(8, 16))


@pytest.mark.parametrize("kind", ["tensor count", "metadata count", "key length", "array length",
                                  "dimension count", "dimension", "tensor type", "tensor offset",
                                  "truncated"])
def test_gguf_headers_that_lie_are_refused(tmp_path, kind):
    data = tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    path = tmp_path / "liar.gguf"
    lie(path, data, gguf_lies(data)[kind])
    message = refused_within_bounded_memory(GGUFSource, path, ConversionError)
    assert "not a readable GGUF file" in message


def safetensors_lies(data: bytes) -> dict[str, bytes]:
    """Variants of a safetensors file: (header length u64, JSON header, tensor bytes)."""
    length = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + length])
    body = data[8 + length:]

    def rebuilt(changed: dict) -> bytes:
        text = json.dumps(changed).encode()
        return struct.pack("<Q", len(text)) + text + body

    name = next(k for k in header if k != "__metadata__")
    entry = header[name]
    begin, end = entry["data_offsets"]
    return {
        "header length": struct.pack("<Q", HUGE) + data[8:],
        "header length past the end": struct.pack("<Q", len(data)) + data[8:],
        "offsets past the end": rebuilt({**header, name: {
            **entry, "data_offsets": [begin, end + HUGE]}}),
        "shape larger than its bytes": rebuilt({**header, name: {
            **entry, "shape": [2**31, 2**31]}}),
        "unknown dtype": rebuilt({**header, name: {**entry, "dtype": "F128"}}),
        "header not JSON": struct.pack("<Q", length) + b"{" * length + body,
        "truncated": data[: len(data) - 16],
    }


LIES = ["header length", "header length past the end", "offsets past the end",
        "shape larger than its bytes", "unknown dtype", "header not JSON", "truncated"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama checkpoint (HF layout) and its converted repository."""
    from family_check import tiny_llama
    directory = tmp_path_factory.mktemp("untrusted")
    tiny_llama(directory, smollm2_tokenizer)
    return directory / "hf", directory / "repo" / "llm"


@pytest.mark.parametrize("kind", LIES)
def test_safetensors_checkpoints_that_lie_are_refused_by_the_converter(tmp_path, checkpoint, kind):
    hf_dir, _ = checkpoint
    liar = tmp_path / "hf"
    shutil.copytree(hf_dir, liar)
    weights = liar / "model.safetensors"
    weights.write_bytes(safetensors_lies(weights.read_bytes())[kind])
    message = refused_within_bounded_memory(lambda path: HFSource(path, trust_pickle=False),
                                            liar, ConversionError)
    assert str(weights) in message


@pytest.mark.parametrize("kind", LIES)
def test_repository_weights_that_lie_are_refused_by_the_engine(tmp_path, checkpoint, kind):
    _, model_dir = checkpoint
    liar = tmp_path / "llm"
    shutil.copytree(model_dir, liar)
    weights = liar / "1" / "weights" / "rank0.safetensors"
    weights.write_bytes(safetensors_lies(weights.read_bytes())[kind])
    with pytest.raises(ValueError) as caught:
        LLM(str(liar))
    assert str(weights) in str(caught.value)


def test_a_repository_with_its_weights_intact_loads(checkpoint):
    _, model_dir = checkpoint
    out = LLM(str(model_dir)).generate([1, 2, 3], SamplingParams(max_tokens=4))
    assert len(out[0].token_ids) == 4
