"""prompt_logprobs, logit_bias and truncate_prompt_tokens on SmolLM2 against transformers (float32):
prompt logprobs are log_softmax of HF's own logits, also over chunked prefills and cached
prefixes; a biased greedy run equals HF's SequenceBiasLogitsProcessor."""
import pytest
import torch

from conftest import hf_greedy
from tritonlm import LLM, SamplingParams
from tritonlm.engine.block_manager import BlockManager
from tritonlm.engine.request_builder import RequestBuilder
from tritonlm.engine.structured_output import Grammars
from tritonlm.errors import InvalidRequestError

TEXT = ("The quick brown fox jumps over the lazy dog. Meanwhile, in a small village by the sea, "
        "an old fisherman mended his nets and told the children stories about the storms, the "
        "ships and the friends of his youth.")
TOP = 5


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(TEXT)
    assert len(ids) > 40  # several chunks of the small engine below
    return ids


@pytest.fixture(scope="module")
def reference(smollm2_hf, prompt):
    """HF's log_softmax over the prompt: row i predicts prompt token i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(smollm2_hf(torch.tensor([prompt])).logits[0].float(), -1)


@pytest.fixture(scope="module")
def chunked_llm(smollm2_repo):
    """Prompts split into 16-token chunks; prefix caching on (the default)."""
    return LLM(str(smollm2_repo), max_num_batched_tokens=16, num_kv_blocks=64)


def grammar_compiler(tokenizer) -> Grammars:
    return Grammars(tokenizer, len(tokenizer), frozenset())


def assert_prompt_logprobs(entries, prompt, reference, top=TOP):
    assert [e["token_id"] for e in entries] == prompt
    assert entries[0]["logprob"] is None and entries[0]["top_logprobs"] == []
    for i, entry in enumerate(entries[1:], 1):
        row = reference[i - 1]
        assert entry["logprob"] == pytest.approx(float(row[prompt[i]]), abs=2e-4), i
        values, ids = row.topk(top)
        ours = entry["top_logprobs"]
        assert [e["logprob"] for e in ours] == pytest.approx(values.tolist(), abs=2e-4)
        # the same ids, up to the order of near-ties
        assert [float(row[e["token_id"]]) for e in ours] == pytest.approx(
            [e["logprob"] for e in ours], abs=2e-4)
        assert sum(e["token_id"] in ids.tolist() for e in ours) >= top - 1


def test_prompt_logprobs_equal_log_softmax_of_transformers_logits(smollm2_llm, prompt, reference):
    out, = smollm2_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2,
                                                         prompt_logprobs=TOP))
    assert_prompt_logprobs(out.prompt_logprobs, prompt, reference)
    tokenizer = smollm2_llm.engine.tokenizer
    assert out.prompt_logprobs[3]["token"] == tokenizer.decode([prompt[3]])


def test_prompt_logprobs_over_chunks_next_to_normal_requests(chunked_llm, smollm2_hf, prompt,
                                                             reference):
    other = prompt[5:30]
    asked, plain = chunked_llm.generate(
        [prompt, other], [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP,
                                         ignore_eos=True),
                          SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
    assert_prompt_logprobs(asked.prompt_logprobs, prompt, reference)
    assert plain.prompt_logprobs is None
    assert asked.token_ids == hf_greedy(smollm2_hf, prompt, 4)
    assert plain.token_ids == hf_greedy(smollm2_hf, other, 4)


def test_prompt_logprobs_compute_a_cached_prefix_again(chunked_llm, prompt, reference):
    scheduler = chunked_llm.engine.scheduler
    params = SamplingParams(temperature=0, max_tokens=1)
    chunked_llm.generate([prompt], params)  # its full blocks are now cached
    hits = scheduler.prefix_cache_hits
    for top in (0, 2):  # run twice: the prompt's blocks stay cached throughout
        out, = chunked_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                             prompt_logprobs=top))
        assert_prompt_logprobs(out.prompt_logprobs, prompt, reference, top)
        assert all(len(e["top_logprobs"]) == top for e in out.prompt_logprobs[1:])
    assert scheduler.prefix_cache_hits == hits  # they did not reuse it
    chunked_llm.generate([prompt], params)
    assert scheduler.prefix_cache_hits > hits  # a plain request still does


def test_prompt_logprobs_come_once_for_several_sequences(smollm2_llm, prompt, reference):
    out, = smollm2_llm.generate([prompt[:20]], SamplingParams(n=3, max_tokens=3, seed=7,
                                                              prompt_logprobs=1))
    assert_prompt_logprobs(out.prompt_logprobs, prompt[:20], reference, top=1)
    assert len(out.choices) == 3


def test_prompt_logprobs_rejected_for_encoder_decoder_models(smollm2_tokenizer):
    builder = RequestBuilder(smollm2_tokenizer, len(smollm2_tokenizer), 64,
                             BlockManager(16, 16), True, grammar_compiler(smollm2_tokenizer))
    with pytest.raises(InvalidRequestError, match="prompt_logprobs.*encoder-decoder"):
        builder.build("t5", "translate this", SamplingParams(prompt_logprobs=1))


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range(value):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams.from_dict({"prompt_logprobs": value})


def hf_biased(model, prompt, bias: dict[int, float], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=steps, eos_token_id=None, pad_token_id=0,
                             sequence_bias={(token,): value for token, value in bias.items()})
    return out[0, len(prompt):].tolist()


def test_greedy_logit_bias_equals_transformers_sequence_bias(smollm2_llm, smollm2_hf, prompt):
    prompt = prompt[:12]
    plain = hf_greedy(smollm2_hf, prompt, 8)
    tokenizer = smollm2_llm.engine.tokenizer
    # ban the first greedy token, favour one that would not come, nudge another
    bias = {plain[0]: -100.0, tokenizer.encode(" banana")[0]: 6.5, plain[2]: -3.0}
    expected = hf_biased(smollm2_hf, prompt, bias, 8)
    assert expected != plain
    json_bias = {str(token): value for token, value in bias.items()}  # OpenAI's string keys
    out, = smollm2_llm.generate([prompt], SamplingParams.from_dict(
        {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "logit_bias": json_bias,
         "logprobs": 0}))
    assert out.token_ids == expected
    # reported logprobs are the raw model's, not the biased distribution's
    with torch.inference_mode():
        logits = smollm2_hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    raw = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    assert [e["logprob"] for e in out.logprobs] == pytest.approx(
        [float(raw[i, t]) for i, t in enumerate(out.token_ids)], abs=2e-4)


def test_logit_bias_in_a_sampled_batch_only_moves_its_row(smollm2_llm, prompt):
    target = smollm2_llm.engine.tokenizer.encode(" banana")[0]
    biased, plain = smollm2_llm.generate(
        [prompt[:10], prompt[:10]],
        [SamplingParams(max_tokens=6, seed=3, logit_bias={target: 100}, ignore_eos=True),
         SamplingParams(max_tokens=6, seed=3, ignore_eos=True)])
    assert biased.token_ids == [target] * 6
    assert target not in plain.token_ids


@pytest.mark.parametrize("bias, match", [
    ({"a": 1}, "logit_bias keys must be token ids"), ({"5": 101}, r"logit_bias\['5'\]"),
    ({"5": float("nan")}, "logit_bias"), ({"5": "1"}, "logit_bias"), ({True: 1}, "token ids"),
    ([1, 2], "logit_bias has the wrong type")])
def test_bad_logit_bias(bias, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams.from_dict({"logit_bias": bias})


def test_logit_bias_outside_the_vocabulary(smollm2_llm):
    vocab = smollm2_llm.engine.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"logit_bias \[{vocab}\] are outside"):
        smollm2_llm.engine.make_request("x", "Hi", SamplingParams(logit_bias={vocab: 1.0}))


def test_truncate_prompt_tokens_equals_sending_the_last_tokens(smollm2_llm, prompt):
    params = dict(temperature=0, max_tokens=6, ignore_eos=True)
    truncated, = smollm2_llm.generate([TEXT], SamplingParams(truncate_prompt_tokens=9, **params))
    direct, = smollm2_llm.generate([prompt[-9:]], SamplingParams(**params))
    assert truncated.prompt_token_ids == prompt[-9:]
    assert truncated.token_ids == direct.token_ids
    short, = smollm2_llm.generate(["Hello"], SamplingParams(truncate_prompt_tokens=50, **params))
    assert short.prompt_token_ids == smollm2_llm.engine.tokenizer.encode("Hello")


def test_truncation_comes_before_the_length_check(smollm2_tokenizer, prompt):
    builder = RequestBuilder(smollm2_tokenizer, len(smollm2_tokenizer), 16,
                             BlockManager(16, 16), False, grammar_compiler(smollm2_tokenizer))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        builder.build("long", prompt)
    request = builder.build("long", TEXT, SamplingParams(truncate_prompt_tokens=15))
    assert request.prompt_token_ids == prompt[-15:] and request.prompt_text is None
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
