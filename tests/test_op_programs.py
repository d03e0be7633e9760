"""CPU op programs (engine/op_programs.py, csrc/op_program.cpp): a recorded step replayed from C++
must do what running the step again does, on new inputs, in place and out of place; what a
program cannot replay must refuse the recording; and an engine's decode steps must run through
programs and still give transformers' greedy tokens, falling back to eager steps where a model
cannot be recorded or the programs' memory is spent."""
import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from family_check import assert_matches_transformers, random_prompts, reference_greedy
from test_quantized_matmul import storage
from tritonlm import SamplingParams
from tritonlm.engine import decode_graphs
from tritonlm.engine.op_programs import ProgramRecorder, RecordingRefused
from tritonlm.layers import cpu_gemm, cpu_kernels
from tritonlm.layers.rotary import RotaryEmbedding

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None or not KERNELS.has_bf16_matmul,
                                reason="needs the C++ CPU kernels")
LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15)


def fresh_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 50, (3,), generator=g),
            "table": torch.randn(50, 64, generator=g).bfloat16(),
            "norm": torch.rand(64, generator=g).bfloat16() + 0.5,
            "weight": torch.randn(96, 64, generator=g).bfloat16(),
            "cos": torch.rand(3, 16, generator=g).bfloat16(),
            "sin": torch.rand(3, 16, generator=g).bfloat16(),
            "cache": torch.zeros(8, 16).bfloat16(), "cache_v": torch.zeros(8, 16).bfloat16(),
            "rows": torch.tensor([1, 4, 6])}


def step(s: dict[str, torch.Tensor]) -> torch.Tensor:
    """Our ops and aten ops, functional and in place, with views between them."""
    x = s["table"][s["ids"]]
    residual = x * 2
    normed = KERNELS.rms_norm(x, s["norm"], 1e-5)
    y = normed @ s["weight"].T  # [3, 96]
    heads = y.view(3, 6, 16)
    KERNELS.rotary_(heads, s["cos"], s["sin"])
    KERNELS.write_kv_(s["cache"], s["cache_v"], heads[:, :1].contiguous(),
                      heads[:, 1:2].contiguous(), s["rows"])
    out = KERNELS.rms_norm(torch.softmax(y[:, :64].float(), -1).bfloat16(), s["norm"], 1e-5,
                           residual)
    out.add_(residual)
    return torch.cat([out, s["cache"].view(-1, 64)[:2]])


@torch.inference_mode()
def test_replay_redoes_the_step_on_new_inputs():
    state = fresh_state(0)
    program = KERNELS.OpProgram()
    with ProgramRecorder(program) as recorder:
        out = step(state)
    assert 0 < len(program) < 20 and recorder.result_storages
    for seed in (1, 2):
        inputs = fresh_state(seed)
        for name in ("ids", "table", "cos", "sin", "rows"):
            state[name].copy_(inputs[name])
        expected_state = {name: t.clone() for name, t in state.items()}
        expected = step(expected_state)
        program.replay()
        assert torch.equal(out, expected)
        for name in state:
            assert torch.equal(state[name], expected_state[name]), name


@torch.inference_mode()
def test_programs_sharing_one_arena_replay_in_turn():
    """The results of programs that never run at once move into one arena: their contents with
    them where asked, and each replay still redoes its own step."""
    states, programs, outs = [fresh_state(0), fresh_state(5)], [], []
    for state in states:
        program = KERNELS.OpProgram()
        with ProgramRecorder(program) as recorder:
            outs.append(step(state))
        needed = program.adopt_results(list(recorder.result_storages))
        assert needed >= outs[-1].nbytes
        programs.append((program, needed))
    arena = torch.empty(max(needed for _, needed in programs), dtype=torch.uint8)
    recorded = outs[1].clone()
    programs[0][0].place_results(arena, with_contents=False)
    programs[1][0].place_results(arena, with_contents=True)
    inside = arena.data_ptr() <= outs[0].data_ptr() < arena.data_ptr() + arena.numel()
    assert inside and torch.equal(outs[1], recorded)
    with pytest.raises(RuntimeError, match="too small"):
        programs[0][0].place_results(arena[:8], with_contents=False)
    for seed in (1, 2, 3):
        which = seed % 2
        state = states[which]
        inputs = fresh_state(seed)
        for name in ("ids", "table", "cos", "sin", "rows"):
            state[name].copy_(inputs[name])
        expected_state = {name: t.clone() for name, t in state.items()}
        expected = step(expected_state)
        programs[which][0].replay()
        assert torch.equal(outs[which], expected)
        for name in state:
            assert torch.equal(state[name], expected_state[name]), name


class CapturingProgram:
    """An OpProgram that also keeps what each recorded op was given and returned."""

    def __init__(self):
        self.program, self.calls = KERNELS.OpProgram(), {}

    def add(self, name, overload, args, kwargs, results):
        self.calls.setdefault(name.split("::")[-1], []).append((kwargs, results))
        self.program.add(name, overload, args, kwargs, results)


def kernel_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(3, 64, generator=g).bfloat16(),
            "norm": (torch.rand(64, generator=g) + 0.5).bfloat16(),
            "keys": torch.randn(4, 4, 16, generator=g).bfloat16(),
            "values": torch.randn(4, 4, 16, generator=g).bfloat16(),
            "rows": torch.randperm(4, generator=g)[:2].repeat(3, 1, 1),
            "context": torch.randint(1, 9, (3,), generator=g)}


def kernel_step(s: dict[str, torch.Tensor], gated, quantized) -> torch.Tensor:
    """Each of our ops that returns a new tensor: norm, bf16 and int4 matmuls, activation,
    decode attention."""
    normed = KERNELS.rms_norm(s["x"], s["norm"], 1e-5)
    hidden = KERNELS.act_and_mul(gated.matmul(normed, None), 0)  # [3, 224]
    q = quantized.matmul(hidden, None).view(3, 5, 16)
    return KERNELS.decode_attention(q, s["keys"], s["values"], s["rows"], s["context"], 0.25)


@torch.inference_mode()
def test_our_kernels_replay_into_the_results_they_recorded():
    """Our ops are recorded writing into the tensor they returned (their `out`), so a replay
    copies no result after them; replays still redo the step on new inputs."""
    gated = cpu_gemm.PairBlockWeight(torch.randn(448, 64).bfloat16(), KERNELS, gated=True)
    quantized = storage(4, 32)  # [80, 224] int4, groups of 32
    state = kernel_state(0)
    kernel_step(state, gated, quantized)  # packs the int4 weight (its first matmul does)
    program = CapturingProgram()
    with ProgramRecorder(program):
        out = kernel_step(state, gated, quantized)
    for name in ("rms_norm", "bf16_matmul", "act_and_mul", "quantized_matmul",
                 "decode_attention"):
        [(kwargs, results)] = program.calls[name]
        assert kwargs["out"] is results[0], name
    for seed in (1, 2):
        inputs = kernel_state(seed)
        expected = kernel_step(inputs, gated, quantized)
        for name, tensor in inputs.items():
            state[name].copy_(tensor)
        program.program.replay()
        assert torch.equal(out, expected)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="needs oneDNN's bfloat16 matmul")
@torch.inference_mode()
def test_onednn_weights_replay():
    """oneDNN's prepacked weight (cpu_gemm.OneDnnWeight: AMX hosts' bf16 matmul) is an opaque
    tensor without a storage; a step multiplying by it records and replays like any other."""
    weight = torch.randn(96, 64).bfloat16()
    packed = cpu_gemm.OneDnnWeight(weight, 4)
    x = torch.randn(3, 64).bfloat16()
    program = KERNELS.OpProgram()
    with ProgramRecorder(program):
        out = packed.matmul(x, None).mul(2)
    x.copy_(torch.randn(3, 64).bfloat16())
    program.replay()
    assert torch.equal(out, F.linear(x, weight).mul(2))


@torch.inference_mode()
def test_views_are_not_recorded():
    x = torch.randn(4, 6)
    program = KERNELS.OpProgram()
    with ProgramRecorder(program):
        y = x.view(2, 12)[:, 3:].t().unsqueeze(0).to(torch.float32)[0]
        z = y.mul(3)
    assert len(program) == 1
    x.fill_(1)
    program.replay()
    assert torch.equal(z, torch.full_like(z, 3))


@pytest.mark.parametrize("what", ["item", "bool", "python data", "nonzero"])
@torch.inference_mode()
def test_value_dependent_steps_are_refused(what):
    x = torch.randn(5)
    steps = {"item": lambda: x * x.max().item(),
             "bool": lambda: x * 2 if bool((x > 0).any()) else x,
             "python data": lambda: x + torch.tensor([1.0, 2, 3, 4, 5]),
             "nonzero": lambda: x[x > 0]}
    with pytest.raises(RecordingRefused), ProgramRecorder(KERNELS.OpProgram()):
        steps[what]()


def recorded_sizes(llm) -> list[int]:
    graphs = llm.engine.runner.decode_graphs
    assert all(isinstance(p, KERNELS.OpProgram) for p in graphs.graphs.values())
    return sorted(size for size, lora in graphs.graphs if not lora)


@pytest.mark.parametrize("model_class,config_class,settings", [
    (LlamaForCausalLM, LlamaConfig, LLAMA),
    (MistralForCausalLM, MistralConfig, {**LLAMA, "sliding_window": 7})], ids=["llama", "mistral"])
def test_decode_steps_run_as_programs_with_transformers_tokens(
        tmp_path, smollm2_tokenizer, model_class, config_class, settings):
    config = config_class(**settings, vocab_size=len(smollm2_tokenizer))
    llm, hf, _ = assert_matches_transformers(tmp_path, model_class, config, smollm2_tokenizer,
                                             num_prompts=3, new_tokens=10)
    assert recorded_sizes(llm) == [1, 3]
    # Batches shrinking as sequences finish replay the programs of every size on the way.
    prompts = random_prompts(5, config.vocab_size, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(5)]
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [reference_greedy(hf, p, 3 + 2 * i)
                                              for i, p in enumerate(prompts)]
    assert recorded_sizes(llm) == [1, 2, 3, 4, 5]
    # Past 8 rows a step runs as the next multiple of 8, its padding rows writing to and
    # attending over the scratch block no sequence owns.
    prompts = random_prompts(11, config.vocab_size, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True)
              for i in range(11)]
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [reference_greedy(hf, p, 2 + i)
                                              for i, p in enumerate(prompts)]
    assert recorded_sizes(llm) == [1, 2, 3, 4, 5, 6, 7, 8, 16]


def test_unrecordable_models_and_spent_memory_decode_eagerly(
        tmp_path, smollm2_tokenizer, monkeypatch, caplog):
    config = LlamaConfig(**LLAMA, vocab_size=len(smollm2_tokenizer))
    monkeypatch.setattr(decode_graphs, "PROGRAM_MEMORY", 1)  # no program fits
    llm, _, _ = assert_matches_transformers(tmp_path / "a", LlamaForCausalLM, config,
                                            smollm2_tokenizer, num_prompts=3, new_tokens=6)
    assert recorded_sizes(llm) == [] and llm.engine.runner.decode_graphs.arena is None

    cos_sin = RotaryEmbedding.cos_sin

    def reading_a_value(self, positions, meta, dtype):
        assert positions.max().item() >= 0  # what a program could not retake
        return cos_sin(self, positions, meta, dtype)
    monkeypatch.setattr(RotaryEmbedding, "cos_sin", reading_a_value)
    with caplog.at_level(logging.WARNING, logger="tritonlm.engine.decode_graphs"):
        llm, _, _ = assert_matches_transformers(tmp_path / "b", LlamaForCausalLM, config,
                                                smollm2_tokenizer, num_prompts=3, new_tokens=6)
    assert recorded_sizes(llm) == []
    assert "cannot be recorded" in caplog.text and "aten.item" in caplog.text
