"""The converter end to end: the default GGUF against transformers' own GGUF loading, tiny HF checkpoints,
re-runs, and the command line's error handling."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM)
from family_check import byte_tokenizer
from tritonlm.config import KV_CACHE_MEMORY_VARIABLE, EngineConfig
from tritonlm.triton.contract import render_config_pbtxt

from tritonlm_convert.cli import main
from tritonlm_convert.convert import convert, default_gguf_path
from tritonlm_convert.errors import ConversionError

TEXTS = ["Hello world!", "  leading spaces,\ttabs\nand newlines\n\n", "Ünïcödé — emoji 🤖 and 中文",
         "<|im_start|>user\nhi<|im_end|>\n", "don't you're I'll", "snake_case(x) -> {'a': [b]}"]
DIGIT_TEXTS = ["a1b22 3333 x=12345;", "2024-01-01 3.14159", "hello 12 worlds"]
MESSAGES = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "Thanks"}]


def weights(model_dir: Path) -> Path:
    return model_dir / "1" / "weights"


@pytest.fixture(scope="module")
def default_repo(tmp_path_factory):
    return convert("default", tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="module")
def reference():
    """transformers' own loading of the same GGUF file."""
    path = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def test_default_repository_layout(default_repo):
    assert default_repo.name == "llm"
    version = default_repo / "1"
    assert sorted(p.name for p in weights(default_repo).iterdir()) == [
        "config.json", "generation_config.json", "rank0.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"]
    model_py = (version / "model.py").read_text().splitlines()
    assert len(model_py) == 2 and model_py[0].startswith('"""')
    assert model_py[1] == "from tritonlm.triton.adapter import TritonPythonModel  # noqa: F401"
    engine = EngineConfig.load(version)
    assert (engine.dtype, engine.max_model_len) == ("auto", 8192)  # chosen where the engine loads
    parameters = {"architecture": "LlamaForCausalLM", "max_model_len": "8192", "tp_size": "1",
                  "dtype": "auto", "quantization": "none"}
    kind = "KIND_GPU" if torch.cuda.is_available() else "KIND_CPU"
    assert (default_repo / "config.pbtxt").read_text() == render_config_pbtxt("llm", kind, parameters)
    assert not [p for p in default_repo.iterdir() if p.name.startswith(".")]


def test_default_weights_equal_transformers_gguf_loading(default_repo, reference):
    expected = reference.state_dict()
    ours = load_file(weights(default_repo) / "rank0.safetensors")
    assert "lm_head.weight" not in ours and reference.config.tie_word_embeddings  # tied embeddings
    assert sorted(ours) == sorted(set(expected) - {"lm_head.weight"})
    for name, tensor in ours.items():  # dtype auto keeps the dequantized weights in float32
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name


def test_default_config_matches_transformers(default_repo, reference):
    expected = reference.config
    raw = json.loads((weights(default_repo) / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["torch_dtype"] == "float32"
    assert raw["rope_theta"] == 100000.0 and raw["rms_norm_eps"] == 1e-5
    ours = AutoConfig.from_pretrained(weights(default_repo))
    for field in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                  "tie_word_embeddings", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, field) == getattr(expected, field), field
    assert ours.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)
    assert ours.rope_parameters["rope_theta"] == expected.rope_parameters["rope_theta"]
    generation = json.loads((weights(default_repo) / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_default_tokenizer_matches_transformers(default_repo, smollm2_tokenizer):
    ours = AutoTokenizer.from_pretrained(weights(default_repo))
    for text in TEXTS + DIGIT_TEXTS:  # transformers' GGUF tokenizer also ends up splitting digits here
        assert ours.encode(text) == smollm2_tokenizer.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    for text in DIGIT_TEXTS:  # the original SmolLM2 tokenizer puts every digit in its own token
        pieces = [ours.decode([i]) for i in ours.encode(text)]
        assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p)), pieces
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "all_special_tokens"):
        assert getattr(ours, attr) == getattr(smollm2_tokenizer, attr), attr
    assert ours.decode(ours.encode("<|im_start|>hi"), skip_special_tokens=True) == "hi"


def test_default_chat_template_renders_like_transformers(default_repo, smollm2_tokenizer):
    ours = AutoTokenizer.from_pretrained(weights(default_repo))
    for generation_prompt in (True, False):
        rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
        assert rendered == smollm2_tokenizer.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
    assert rendered.startswith("<|im_start|>system\n")
    tokenizer_config = json.loads((weights(default_repo) / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == smollm2_tokenizer.chat_template
    assert tokenizer_config["add_bos_token"] is False
    special = json.loads((weights(default_repo) / "special_tokens_map.json").read_text())
    assert special == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                       "pad_token": "<|im_end|>"}


def _save_tiny(directory: Path, config_class=LlamaConfig, model_class=LlamaForCausalLM, **overrides) -> dict:
    """A random tiny model saved in bfloat16 with its tokenizer; returns its state dict."""
    torch.manual_seed(0)
    config = config_class(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rope_theta=5e5,
                          bos_token_id=256, eos_token_id=257, **overrides)
    model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return model.state_dict()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    return directory, _save_tiny(directory)


def _console_script() -> list[str]:
    script = Path(sys.executable).parent / "tritonlm-convert"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tritonlm_convert"]


def test_hf_directory_through_the_command_line(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv(KV_CACHE_MEMORY_VARIABLE, raising=False)  # engine.json as written
    source, state = tiny
    result = subprocess.run(
        [*_console_script(), str(source), "--output", str(tmp_path), "--name", "tiny", "--dtype", "bfloat16",
         "--max-model-len", "128", "--instance-kind", "KIND_GPU"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    model_dir = tmp_path / "tiny"
    ours = load_file(weights(model_dir) / "rank0.safetensors")
    assert sorted(ours) == sorted(state) and "lm_head.weight" in ours
    for name, tensor in state.items():
        assert ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], tensor), name
    source_config = json.loads((source / "config.json").read_text())
    config = json.loads((weights(model_dir) / "config.json").read_text())
    assert {k: config[k] for k in source_config if k != "dtype"} == \
           {k: v for k, v in source_config.items() if k != "dtype"}
    assert (config["torch_dtype"], config["rope_theta"], config["rope_scaling"]) == ("bfloat16", 5e5, None)
    assert EngineConfig.load(model_dir / "1") == EngineConfig(dtype="bfloat16", max_model_len=128)
    pbtxt = (model_dir / "config.pbtxt").read_text()
    parameters = {"architecture": "LlamaForCausalLM", "max_model_len": "128", "tp_size": "1",
                  "dtype": "bfloat16", "quantization": "none"}
    assert pbtxt == render_config_pbtxt("tiny", "KIND_GPU", parameters)
    original, converted = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(weights(model_dir))
    for text in TEXTS:
        assert converted.encode(text) == original.encode(text)
    assert converted.encode("hi")[0] == 256
    assert json.loads((weights(model_dir) / "tokenizer_config.json").read_text())["add_bos_token"] is True
    assert converted.apply_chat_template(MESSAGES, tokenize=False) == "What is 2+2?4Thanks"


def test_rerun_replaces_previous_output(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    source, state = tiny
    model_dir = convert(str(source), tmp_path)
    stale = [weights(model_dir) / "rank1.safetensors", weights(model_dir) / "chat_template.jinja"]
    for path in stale:
        path.write_text("stale")
    assert convert(str(source), tmp_path) == model_dir
    assert not any(path.exists() for path in stale)
    assert not [p for p in model_dir.iterdir() if p.name.startswith(".")]
    ours = load_file(weights(model_dir) / "rank0.safetensors")
    for name, tensor in state.items():  # dtype auto: the checkpoint's bfloat16, as it is
        assert ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], tensor), name
    assert EngineConfig.load(model_dir / "1").dtype == "auto"
    assert 'kind: KIND_CPU' in (model_dir / "config.pbtxt").read_text()


def test_with_cuda_the_model_is_placed_on_gpus(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model_dir = convert(str(tiny[0]), tmp_path)
    assert 'kind: KIND_GPU' in (model_dir / "config.pbtxt").read_text()


def test_mistral_uses_the_llama_layout(tmp_path):
    source = tmp_path / "tiny-mistral"
    state = _save_tiny(source, MistralConfig, MistralForCausalLM, sliding_window=64)
    model_dir = convert(str(source), tmp_path / "repo", dtype="float32")
    ours = load_file(weights(model_dir) / "rank0.safetensors")
    assert all(torch.equal(ours[name], tensor.float()) for name, tensor in state.items())
    config = json.loads((weights(model_dir) / "config.json").read_text())
    assert (config["architectures"], config["sliding_window"]) == (["MistralForCausalLM"], 64)
    assert 'string_value: "MistralForCausalLM"' in (model_dir / "config.pbtxt").read_text()


# llama.cpp's tensor names and the quant types this test stores each tensor in.
GGUF_LAYOUT = {"model.embed_tokens.weight": ("token_embd", "F16"), "model.norm.weight": ("output_norm", "F32"),
               "lm_head.weight": ("output", "Q8_0")}
GGUF_LAYER_LAYOUT = {"self_attn.q_proj": ("attn_q", "F32"), "self_attn.k_proj": ("attn_k", "F32"),
                     "self_attn.v_proj": ("attn_v", "Q8_0"), "self_attn.o_proj": ("attn_output", "BF16"),
                     "mlp.gate_proj": ("ffn_gate", "Q4_0"), "mlp.up_proj": ("ffn_up", "Q4_1"),
                     "mlp.down_proj": ("ffn_down", "Q5_0"), "input_layernorm": ("attn_norm", "F32"),
                     "post_attention_layernorm": ("ffn_norm", "F32")}


def _llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def _write_tiny_gguf(path: Path, state: dict, config, layer_layout: dict = GGUF_LAYER_LAYOUT) -> None:
    """The tiny Llama as convert_hf_to_gguf.py would store it, with a byte-level vocabulary and rope scaling;
    `layer_layout` names each layer tensor's llama.cpp name and quant type."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(2.0)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "<s>", "</s>"]
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2)
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    for name, tensor in state.items():
        if name in GGUF_LAYOUT:
            gguf_name, kind = GGUF_LAYOUT[name]
        else:
            layer, part = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name).groups()
            base, kind = layer_layout[part]
            gguf_name = f"blk.{layer}.{base}"
        weight = tensor.float().numpy()
        if gguf_name.endswith("attn_q"):
            weight = _llama_cpp_permute(weight, config.num_attention_heads)
        elif gguf_name.endswith("attn_k"):
            weight = _llama_cpp_permute(weight, config.num_key_value_heads)
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(f"{gguf_name}.weight", gguf.quants.quantize(weight, qtype),
                          raw_dtype=None if kind in ("F32", "F16") else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_with_every_quant_layout_round_trips(tmp_path):
    source = tmp_path / "tiny"
    state = {name: tensor.float() for name, tensor in _save_tiny(source).items()}
    config = AutoConfig.from_pretrained(source)
    _write_tiny_gguf(tmp_path / "tiny.gguf", state, config)
    model_dir = convert(str(tmp_path / "tiny.gguf"), tmp_path / "repo")
    ours = load_file(weights(model_dir) / "rank0.safetensors")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).state_dict()
    assert sorted(ours) == sorted(expected) == sorted(state)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name
        if name.endswith(("q_proj.weight", "k_proj.weight", "norm.weight")):  # stored as F32: lossless
            assert torch.equal(ours[name], state[name]), name
    converted = json.loads((weights(model_dir) / "config.json").read_text())
    assert converted["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert AutoConfig.from_pretrained(weights(model_dir)).rope_parameters == {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    assert (converted["tie_word_embeddings"], converted["head_dim"], converted["vocab_size"]) == (False, 16, 300)


def test_pickle_weights_need_trust(tiny, tmp_path):
    source = tmp_path / "pickled"
    shutil.copytree(tiny[0], source)
    (source / "model.safetensors").unlink()
    torch.save(tiny[1], source / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="--trust-pickle"):
        convert(str(source), tmp_path / "repo")
    model_dir = convert(str(source), tmp_path / "repo", trust_pickle=True, dtype="bfloat16")
    ours = load_file(weights(model_dir) / "rank0.safetensors")
    assert all(torch.equal(ours[name], tensor) for name, tensor in tiny[1].items())


def _bad_sources(tmp: Path, tiny_dir: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "empty").mkdir()
    (tmp / "corrupt.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 4)
    (tmp / "notes.txt").write_text("hello")
    gptj = tmp / "gptj"
    shutil.copytree(tiny_dir, gptj)
    config = json.loads((gptj / "config.json").read_text())
    (gptj / "config.json").write_text(json.dumps({**config, "architectures": ["GPTJForCausalLM"]}))
    return {
        "missing": ([str(tmp / "nope")], "does not exist"),
        "no config.json": ([str(tmp / "empty")], "has no config.json"),
        "corrupt gguf": ([str(tmp / "corrupt.gguf")], "not a readable GGUF file"),
        "not a model": ([str(tmp / "notes.txt")], "neither a Hugging Face model directory nor a .gguf file"),
        "architecture": ([str(gptj)], r"unsupported architecture \['GPTJForCausalLM'\]; "
                                      "supported: BloomForCausalLM, FalconForCausalLM, "),
        "context too long": ([str(tiny_dir), "--max-model-len", "257"], "between 1 and the model's 256"),
    }


def test_bad_sources_are_one_line_errors(tiny, tmp_path, capsys):
    for case, (args, message) in _bad_sources(tmp_path, tiny[0]).items():
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--output", str(tmp_path / "repo")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 1, case
        assert err.startswith("tritonlm-convert: error: ") and err.count("\n") == 1, (case, err)
        assert re.search(message, err), (case, err)
    assert not (tmp_path / "repo").exists()


def test_error_exit_has_no_traceback(tmp_path):
    result = subprocess.run([*_console_script(), str(tmp_path / "nope"), "-o", str(tmp_path / "repo")],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr == f"tritonlm-convert: error: {tmp_path / 'nope'} does not exist\n"


def test_kv_cache_memory_sizes_the_cache(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(KV_CACHE_MEMORY_VARIABLE, raising=False)  # conftest's, for the others
    main([str(tiny[0]), "--output", str(tmp_path / "repo"), "--dtype", "float32",
          "--kv-cache-memory", "3MiB"])
    model_dir = tmp_path / "repo" / "llm"
    assert EngineConfig.load(model_dir / "1").kv_cache_memory == 3 << 20
    from tritonlm.engine.llm_engine import LLMEngine
    engine = LLMEngine(model_dir)
    config = json.loads((weights(model_dir) / "config.json").read_text())
    # K and V, every layer, kv heads x block_size x head_dim float32 values per block
    block_bytes = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                   * engine.config.block_size * config["head_dim"] * 4)
    assert engine.runner.num_blocks == (3 << 20) // block_bytes
    with pytest.raises(SystemExit):
        main([str(tiny[0]), "--output", str(tmp_path / "other"), "--kv-cache-memory", "lots"])
    assert "not a memory size: 'lots'" in capsys.readouterr().err


def test_the_environment_sizes_the_cache_over_engine_json(tiny, tmp_path, monkeypatch):
    main([str(tiny[0]), "--output", str(tmp_path / "repo"), "--kv-cache-memory", "3MiB"])
    version = tmp_path / "repo" / "llm" / "1"
    monkeypatch.setenv(KV_CACHE_MEMORY_VARIABLE, "2 MiB")
    assert EngineConfig.load(version).kv_cache_memory == 2 << 20
    assert EngineConfig.load(version, kv_cache_memory=5 << 20).kv_cache_memory == 5 << 20
    monkeypatch.setenv(KV_CACHE_MEMORY_VARIABLE, "half")
    with pytest.raises(ValueError, match=f"not a {KV_CACHE_MEMORY_VARIABLE}: 'half'"):
        EngineConfig.load(version)


def test_gpu_memory_utilization_is_recorded_and_checked(tiny, tmp_path, capsys):
    main([str(tiny[0]), "--output", str(tmp_path / "repo"), "--gpu-memory-utilization", "0.5"])
    assert EngineConfig.load(tmp_path / "repo" / "llm" / "1").gpu_memory_utilization == 0.5
    with pytest.raises(SystemExit):
        main([str(tiny[0]), "--output", str(tmp_path / "other"), "--gpu-memory-utilization", "1.5"])
    assert "gpu_memory_utilization must be in (0, 1], got 1.5" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_speculative_settings_are_recorded_and_checked(tiny, tmp_path, capsys):
    main([str(tiny[0]), "--output", str(tmp_path / "repo"), "--speculative", "ngram",
          "--num-speculative-tokens", "3"])
    config = EngineConfig.load(tmp_path / "repo" / "llm" / "1")
    assert (config.speculative, config.num_speculative_tokens) == ("ngram", 3)
    with pytest.raises(SystemExit):
        main([str(tiny[0]), "--output", str(tmp_path / "other"), "--speculative", "ngram",
              "--num-speculative-tokens", "0"])
    assert "num_speculative_tokens must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_limits_are_recorded_and_checked(tiny, tmp_path, capsys):
    main([str(tiny[0]), "--output", str(tmp_path / "repo"), "--max-concurrent-requests", "7",
          "--max-input-tokens", "30", "--max-total-tokens", "40", "--queue-timeout", "2.5",
          "--max-best-of", "2", "--max-stop-sequences", "4", "--max-top-n-tokens", "5"])
    config = EngineConfig.load(tmp_path / "repo" / "llm" / "1")
    assert (config.max_concurrent_requests, config.max_input_tokens, config.max_total_tokens,
            config.queue_timeout) == (7, 30, 40, 2.5)
    assert (config.max_best_of, config.max_stop_sequences, config.max_top_n_tokens) == (2, 4, 5)
    with pytest.raises(SystemExit):
        main([str(tiny[0]), "--output", str(tmp_path / "other"), "--max-input-tokens", "40",
              "--max-total-tokens", "40"])
    assert "max_input_tokens must be in [1, max_total_tokens (40) - 1], got 40" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_a_draft_model_is_recorded_by_its_absolute_path(tiny, tmp_path, capsys, monkeypatch):
    main([str(tiny[0]), "--output", str(tmp_path / "draft"), "--dtype", "float32"])
    monkeypatch.chdir(tmp_path)
    main([str(tiny[0]), "--output", str(tmp_path / "repo"), "--speculative", "draft/llm"])
    config = EngineConfig.load(tmp_path / "repo" / "llm" / "1")
    assert config.speculative == str(tmp_path / "draft" / "llm" / "1")
    with pytest.raises(SystemExit):
        main([str(tiny[0]), "--output", str(tmp_path / "other"), "--speculative", "nowhere"])
    error = capsys.readouterr().err
    assert "--speculative:" in error and "nowhere" in error
    assert not (tmp_path / "other").exists()
