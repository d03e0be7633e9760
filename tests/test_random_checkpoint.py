"""tools/random_checkpoint.py (the GPU benchmark's 8B-shaped model): transformers' own names and
shapes for the config, sharded with an index, and a checkpoint the converter and engine take."""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tritonlm import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from random_checkpoint import SHAPES, write_random_checkpoint  # noqa: E402


def test_a_random_checkpoint_loads_in_transformers_and_converts(tmp_path, smollm2_tokenizer,
                                                                monkeypatch):
    import random_checkpoint
    from tritonlm_convert.convert import convert
    monkeypatch.setattr(random_checkpoint, "SHARD_BYTES", 1 << 20)  # several shards
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=len(smollm2_tokenizer))
    write_random_checkpoint(config, tmp_path / "hf", torch.bfloat16, torch.device("cpu"))
    smollm2_tokenizer.save_pretrained(tmp_path / "hf")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    tensors = {k: v for shard in shards for k, v in load_file(tmp_path / "hf" / shard).items()}
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert sorted(tensors) == sorted(reference.state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    weight = tensors["model.layers.0.mlp.up_proj.weight"].float()
    assert 0.015 < weight.std() < 0.025 and torch.equal(
        tensors["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    llm = LLM(str(convert(str(tmp_path / "hf"), tmp_path / "repo", dtype="bfloat16")))
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True,
                                                        temperature=0))[0].token_ids) == 4


def test_the_8b_shape_is_llama_3_8b():
    config = SHAPES["llama-3-8b"]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert 8.0e9 < sum(p.numel() for p in model.parameters()) < 8.1e9
    assert (config.num_key_value_heads, config.vocab_size) == (8, 128256)
