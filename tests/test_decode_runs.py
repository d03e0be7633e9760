"""Decode runs (num_scheduler_steps; engine/decode_run.py): several decode steps per schedule, each
step's input ids taken on the device from the step before. On CPU they go through the op
programs' buffers as on CUDA through the graphs' (tests/test_gpu.py runs them there): greedy
tokens must stay transformers', and sampled tokens, logprobs, stops and finish reasons those of
one step at a time."""
import pytest

from family_check import random_prompts, reference_greedy, tiny_llama
from tritonlm import LLM, SamplingParams
from tritonlm.layers import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="needs the C++ CPU kernels")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_tokenizer):
    return tiny_llama(tmp_path_factory.mktemp("decode-runs"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def engines(tiny):
    """One step at a time, and runs of up to 5 steps whose plans are counted."""
    _, repo = tiny
    single = LLM(str(repo), block_size=8, num_scheduler_steps=1)
    runs = LLM(str(repo), block_size=8, num_scheduler_steps=5)
    assert single.engine.runner.max_decode_run == 1 and runs.engine.runner.max_decode_run == 5
    runner = runs.engine.runner
    execute, runs.steps = runner.execute, []

    def counting(plan):
        runs.steps.append(plan.num_steps)
        return execute(plan)
    runner.execute = counting
    return single, runs


def test_greedy_runs_give_transformers_tokens(tiny, engines):
    hf, _ = tiny
    _, runs = engines
    prompts = random_prompts(6, hf.config.vocab_size, seed=4)
    lengths = [3 + 6 * i for i in range(len(prompts))]  # runs cut short as each one ends
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    runs.steps.clear()
    outputs = runs.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [reference_greedy(hf, p, n)
                                              for p, n in zip(prompts, lengths)]
    assert [o.finish_reason for o in outputs] == ["length"] * len(prompts)
    assert max(runs.steps) == 5 and len(set(runs.steps)) >= 3, runs.steps


def test_sampled_tokens_and_logprobs_equal_single_steps(engines):
    single, runs = engines
    prompts = random_prompts(4, 1000, seed=5)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=17, logprobs=3,
                             ignore_eos=True) for i in range(len(prompts))]
    runs.steps.clear()
    ours, theirs = runs.generate(prompts, params), single.generate(prompts, params)
    assert max(runs.steps) == 5
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        assert [e["top_logprobs"] for e in a.logprobs] == [e["top_logprobs"] for e in b.logprobs]
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)


def test_stops_inside_a_run_end_where_single_steps_end(engines, smollm2_tokenizer):
    single, runs = engines
    prompts = random_prompts(3, 1000, seed=6)
    plain = single.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                    ignore_eos=True))
    # Stop at each prompt's 8th token, and at the 9th's text: mid-run for runs of 5.
    stop_ids = [[o.token_ids[7]] for o in plain]
    stop_text = [smollm2_tokenizer.decode(o.token_ids[8:9]).strip() for o in plain]
    for params in ([SamplingParams(temperature=0, max_tokens=24, stop_token_ids=ids)
                    for ids in stop_ids],
                   [SamplingParams(temperature=0, max_tokens=24, stop=[text])
                    for text in stop_text if text]):
        expected = single.generate(prompts[:len(params)], params)
        got = runs.generate(prompts[:len(params)], params)
        assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in got] == \
            [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in expected]
        assert all(len(o.token_ids) < 24 for o in got)
    engine = runs.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_request_needing_host_state_decodes_step_by_step_beside_runs(tiny, engines):
    hf, _ = tiny
    _, runs = engines
    prompts = random_prompts(2, hf.config.vocab_size, seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    penalized = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                               repetition_penalty=1.0, frequency_penalty=0.5)
    runs.steps.clear()
    outputs = runs.generate(prompts, [greedy, penalized])
    assert outputs[0].token_ids == reference_greedy(hf, prompts[0], 12)
    # While the penalized request runs every step is single; after it ends the other runs.
    assert runs.steps[:6] == [1] * 6 and max(runs.steps) > 1, runs.steps
