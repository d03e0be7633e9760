"""Speculative decoding with n-gram prompt lookup (engine/ngram_proposer.py): one target step
verifies each sequence's proposals. Greedy tokens must stay transformers', sampled tokens and
logprobs those of the engine without speculation (the draws are keyed by seed and output index,
and a proposal is kept only where the target drew that very token), a token drawn where a
proposal waited must follow transformers' distribution, and no block may leak."""

import json
import re

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch
from scipy.stats import chisquare

from conftest import hf_greedy, linked_repository
from family_check import TINY_LLAMA, byte_tokenizer, random_prompts, reference_greedy, tiny_llama
from tritonlm import LLM, SamplingParams
from tritonlm.engine.ngram_proposer import propose_ngram
from test_observability import delta, scrape
from test_server import grpc_stream, text_of
from triton_server import start_server

SPECULATIVE = dict(speculative="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                   prompt_lookup_max=3, speculative_disable_by_batch_size=64, block_size=8)


def test_ngram_proposals():
    # The longest n-gram ending the tokens wins; of its occurrences, the most recent.
    assert propose_ngram([1, 2, 3, 9, 2, 3, 7, 5, 2, 3], 2, 1, 3) == [7, 5]
    assert propose_ngram([5, 1, 2, 3, 4, 8, 1, 2, 3, 6, 2, 3], 3, 1, 3) == [6, 2, 3]
    assert propose_ngram([4, 1, 2, 8, 9, 1, 2], 5, 2, 2) == [8, 9, 1, 2]
    assert propose_ngram([4, 1, 2, 8, 9, 1, 2], 5, 3, 3) == []  # no 3-gram recurs
    assert propose_ngram([1, 2, 3], 4, 1, 3) == []
    assert propose_ngram([7, 7], 3, 1, 3) == [7]  # the proposal stops at the end of the context
    assert propose_ngram([3], 2, 1, 3) == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_tokenizer):
    return tiny_llama(tmp_path_factory.mktemp("speculative"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def engines(tiny):
    _, repo = tiny
    return LLM(str(repo), block_size=8), LLM(str(repo), **SPECULATIVE)


def repeating_prompts(n: int, seed: int) -> list[list[int]]:
    """Random token runs said twice, or three times: lookup finds proposals at once."""
    return [p * (2 + i % 2) for i, p in enumerate(random_prompts(n, 2000, max_len=12, seed=seed))]


def counters(llm: LLM) -> tuple[int, int]:
    return llm.engine.scheduler.num_draft_tokens, llm.engine.scheduler.num_accepted_tokens


def assert_all_blocks_free(llm: LLM) -> None:
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    assert not llm.engine.scheduler.has_unfinished


def test_greedy_tokens_are_transformers_alone_and_batched(tiny, engines):
    hf, _ = tiny
    _, spec = engines
    prompts = repeating_prompts(6, seed=1) + random_prompts(2, 2000, seed=2)
    lengths = [9 + 5 * i for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    expected = [reference_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    drafted, accepted = counters(spec)
    assert [spec.generate([p], q)[0].token_ids for p, q in zip(prompts, params)] == expected
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    drafted, accepted = (a - b for a, b in zip(counters(spec), (drafted, accepted)))
    # Proposals were made, some kept and some not: both paths of verification ran.
    assert 0 < accepted < drafted, (accepted, drafted)
    assert_all_blocks_free(spec)


# Input-grounded requests, whose answers copy from their prompts: most proposals are kept.
TEXT = ("The Triton Inference Server lets teams deploy models from many frameworks. It batches "
        "requests dynamically, runs several models at once, and reports metrics.")
CODE = ("def add(a, b):\n    return a + b\n\n\ndef scale(values, factor):\n"
        "    return [v * factor for v in values]\n")
TASKS = [f"Repeat this text exactly:\n{TEXT}", f"Rewrite this code with type hints:\n{CODE}",
         f"Fix the spelling: {TEXT.replace('e', 'ee', 3)}", f"Summarise in one line: {TEXT}",
         f"Add a docstring to each function:\n{CODE}"]


@pytest.fixture(scope="module")
def smollm2(smollm2_repo, smollm2_llm):
    """The plain engine, the speculative one, and the tasks as chat prompts."""
    spec = LLM(str(smollm2_repo), **SPECULATIVE)
    tokenizer = spec.engine.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": task}],
                                             add_generation_prompt=True, return_dict=False)
               for task in TASKS]
    return smollm2_llm, spec, prompts


def test_smollm2_greedy_is_transformers_and_keeps_copied_proposals(smollm2, smollm2_hf):
    _, spec, prompts = smollm2
    before = counters(spec)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = spec.generate(prompts[:3], params)
    assert [o.token_ids for o in outputs] == [hf_greedy(smollm2_hf, p, 40) for p in prompts[:3]]
    drafted, accepted = (a - b for a, b in zip(counters(spec), before))
    assert drafted > accepted > drafted / 4, (accepted, drafted)  # 43% here
    assert_all_blocks_free(spec)


def test_sampled_tokens_and_logprobs_equal_no_speculation(smollm2):
    plain, spec, prompts = smollm2
    params = [SamplingParams(temperature=t, top_p=0.9, top_k=50, min_p=0.02, seed=i,
                             max_tokens=30, logprobs=2, logit_bias={13: 2.0})
              for i, t in enumerate([0.3, 0.6, 1.0, 0.6, 0.8])]
    before = counters(spec)
    ours, theirs = spec.generate(prompts, params), plain.generate(prompts, params)
    assert counters(spec)[1] > before[1]
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        # The target's logprobs, from a verification step's kernels rather than a decode's.
        ours_top, theirs_top = ([(t["token_id"], t["logprob"]) for e in o.logprobs
                                 for t in e["top_logprobs"]] for o in (a, b))
        assert [t for t, _ in ours_top] == [t for t, _ in theirs_top]
        assert [p for _, p in ours_top] == pytest.approx([p for _, p in theirs_top], abs=1e-4)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


def test_mixed_batch_n_best_of_and_stops_equal_no_speculation(smollm2):
    plain, spec, prompts = smollm2
    prompts = prompts + prompts[:1]
    tokenizer = spec.engine.tokenizer
    greedy = plain.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=30))
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[greedy[0].token_ids[12]]),
        SamplingParams(temperature=0, max_tokens=30,
                       stop=[tokenizer.decode(greedy[1].token_ids[10:12]).strip()]),
        SamplingParams(temperature=0.8, n=3, best_of=4, seed=7, max_tokens=16),
        SamplingParams(temperature=0, max_tokens=25, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=25, speculative=False),
        SamplingParams(temperature=0.7, seed=3, max_tokens=25, watermark=True),
    ]
    ours, theirs = spec.generate(prompts, params), plain.generate(prompts, params)
    for a, b in zip(ours, theirs):
        assert [(s.token_ids, s.text, s.finish_reason, s.stop_reason) for s in a.choices] == \
            [(s.token_ids, s.text, s.finish_reason, s.stop_reason) for s in b.choices]
    assert [o.finish_reason for o in ours[:2]] == ["stop", "stop"]
    assert_all_blocks_free(spec)


def test_penalties_bad_words_and_min_tokens_equal_no_speculation(smollm2):
    """Each verification row draws with the token counts, bad-word bans and min_tokens state of
    the proposals before it; the proposals refused are uncounted at the next step."""
    plain, spec, prompts = smollm2
    tokenizer = spec.engine.tokenizer
    greedy = plain.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=30))[0]
    params = [
        SamplingParams(temperature=0, max_tokens=40, frequency_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=40, presence_penalty=1.0, repetition_penalty=1.1),
        SamplingParams(temperature=0.8, seed=5, max_tokens=40, repetition_penalty=1.1,
                       frequency_penalty=0.3, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30,
                       bad_words=[tokenizer.decode(greedy.token_ids[8:10]).strip()]),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20,
                       stop_token_ids=[greedy.token_ids[5]]),
    ]
    prompts = prompts[:3] + prompts[:1] * 2  # the last two: greedy's prompt
    before = counters(spec)
    ours, theirs = spec.generate(prompts, params), plain.generate(prompts, params)
    drafted, accepted = (a - b for a, b in zip(counters(spec), before))
    assert drafted > accepted > 0
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)
    # the bans were live: the bad word and the early stop token were drawn without them
    assert ours[3].token_ids[:10] != greedy.token_ids[:10] and len(ours[4].token_ids) >= 20
    assert_all_blocks_free(spec)


def test_structured_output_equals_no_speculation(smollm2):
    """A verification row's grammar mask is its matcher's after the proposals before it (walked
    and rolled back); proposals the grammar refuses are never kept."""
    plain, spec, prompts = smollm2
    words, schema = r"[A-Za-z ,.]+", {"type": "object", "properties": {"text": {"type": "string"}},
                                       "required": ["text"]}
    choices = [TEXT, TEXT.upper()]
    params = [
        SamplingParams(temperature=0, max_tokens=40, guided_regex=words),
        SamplingParams(temperature=0, max_tokens=60, guided_json=schema),
        SamplingParams(temperature=0.7, seed=9, max_tokens=40, guided_regex=words),
        SamplingParams(temperature=0, max_tokens=60, guided_choice=choices),
    ]
    prompts = prompts[:1] * 4
    before = counters(spec)
    ours, theirs = spec.generate(prompts, params), plain.generate(prompts, params)
    drafted, accepted = (a - b for a, b in zip(counters(spec), before))
    assert drafted > accepted > 0
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert re.fullmatch(words, ours[0].text) and re.fullmatch(words, ours[2].text)
    jsonschema.validate(json.loads(ours[1].text), schema)
    assert ours[3].text in choices
    assert_all_blocks_free(spec)


def test_preemption_and_prefix_caching_keep_outputs(smollm2_repo, smollm2):
    plain, _, prompts = smollm2
    llm = LLM(str(smollm2_repo), **{**SPECULATIVE, "num_kv_blocks": 40, "max_num_seqs": 8})
    prompts = prompts + [p + [198] for p in prompts]  # the same prefixes again: cache hits
    # every other one penalised: its token counts restart with the recompute
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                             frequency_penalty=1.5 * (i % 2)) for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(prompts, params)]
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.prefix_cache_hits > 0
    assert counters(llm)[1] > 0
    assert_all_blocks_free(llm)


def test_cancelling_mid_speculation_frees_everything(tiny):
    _, repo = tiny
    llm = LLM(str(repo), **SPECULATIVE)
    engine = llm.engine
    for i, prompt in enumerate(repeating_prompts(4, seed=8)):
        engine.add(engine.make_request(f"r{i}", prompt, SamplingParams(
            temperature=0, max_tokens=200, ignore_eos=True)))
    while engine.scheduler.num_accepted_tokens == 0:
        engine.step()
    for i in range(4):
        engine.abort(f"r{i}")
    assert_all_blocks_free(llm)
    assert llm.generate([[1, 2, 3, 1, 2]], SamplingParams(temperature=0, max_tokens=5))


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A tiny Llama over a byte tokenizer's 258 ids, its final norm scaled up so that its
    next-token distributions are peaked: a few thousand draws fill many bins."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from tritonlm_convert.convert import convert
    directory = tmp_path_factory.mktemp("peaked")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, vocab_size=258, bos_token_id=256,
                                      eos_token_id=257)).eval()
    with torch.no_grad():
        hf.model.norm.weight.mul_(3.0)
    hf.save_pretrained(directory / "hf")
    byte_tokenizer().save_pretrained(directory / "hf")
    return hf, convert(str(directory / "hf"), directory / "repo", dtype="float32")


def chained_prompt(hf, vocab: int) -> list[int]:
    """Every id once, each followed by the unused id the model most likely draws after it (given a
    random order of the ids first): lookup proposes after any first token, and often what the
    target draws."""
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        likely = hf(torch.tensor([order + [t] for t in range(vocab)])).logits[:, -1].argsort(
            dim=-1, descending=True).tolist()
    chain = [order[0]]
    unused = set(order[1:])
    while unused:
        chain.append(next(t for t in likely[chain[-1]] if t in unused))
        unused.remove(chain[-1])
    return chain


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_token_drawn_at_a_proposal_follows_transformers_distribution(peaked, proposer):
    """Chi-square over many seeds: the pairs (first token, second token), the second drawn where a
    proposal waited (lookup's from the prompt, or the target as its own draft: its greedy token),
    against transformers' joint distribution; proposals kept often enough that a wrong rule for
    keeping them would show."""
    hf, repo = peaked
    vocab = hf.config.vocab_size
    prompt = chained_prompt(hf, vocab)
    settings = SPECULATIVE if proposer == "ngram" else {
        **SPECULATIVE, "speculative": str(repo), "num_speculative_tokens": 1}
    num_samples, batch = 3000, 50  # batches under speculative_disable_by_batch_size
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True)
              for s in range(num_samples)]
    # The prompt's blocks cached and shared: room for every sequence's proposal (none dropped)
    with LLM(str(repo), **settings, num_kv_blocks=1024, enable_prefix_caching=True) as spec:
        outputs = [o.token_ids for start in range(0, num_samples, batch)
                   for o in spec.generate([prompt] * batch, params[start:start + batch])]
        drafted, kept = counters(spec)
    # max_tokens 3: one proposal for each second token, none for the third
    assert drafted == num_samples and kept > num_samples / 10, (drafted, kept)
    with torch.inference_mode():
        first = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), dim=-1)
        continued = torch.tensor([prompt + [t] for t in range(vocab)])
        second = torch.softmax(hf(continued).logits[:, -1].double(), dim=-1)
    joint = (first[:, None] * second).numpy().ravel()  # of the pair (a, b) at a * vocab + b
    drawn = np.array([o[0] * vocab + o[1] for o in outputs])
    # Bins: pairs expected at least 10 times each, the rest together.
    common = np.flatnonzero(joint * num_samples >= 10)
    assert len(common) >= 10
    observed = [np.sum(drawn == c) for c in common] + [np.sum(~np.isin(drawn, common))]
    expected = np.append(joint[common], 1 - joint[common].sum()) * num_samples
    assert chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.server
def test_served_speculation_counts_drafts_and_logs_acceptance(smollm2_repo, smollm2, tmp_path):
    plain, _, _ = smollm2
    repo = linked_repository(smollm2_repo, tmp_path / "repo", num_kv_blocks=64,
                             speculative="ngram", num_speculative_tokens=4)
    prompt = f"Repeat this text exactly:\n{TEXT}"
    expected = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40))[0].text
    with start_server(repo) as server:
        before = scrape(server)
        results, error = grpc_stream(server.grpc_url, prompt,
                                     {"temperature": 0, "max_tokens": 40}, stream=False)
        assert error is None and text_of(results[-1]) == expected
        after = scrape(server)
        drafted = delta(before, after, "spec_decode_num_draft_tokens_total")
        accepted = delta(before, after, "spec_decode_num_accepted_tokens_total")
        assert drafted > accepted > 0
        assert f"draft_tokens={int(drafted)} accepted={int(accepted)}" in server.logs()
        results, error = grpc_stream(server.grpc_url, prompt, {
            "temperature": 0, "max_tokens": 40, "speculative": False}, stream=False)
        assert error is None and text_of(results[-1]) == expected
        assert delta(after, scrape(server), "spec_decode_num_draft_tokens_total") == 0
        # The front end: TGI's /info reports the proposals per step; OpenAI's requests may
        # turn speculation off (an extension, as vLLM's extra keys are).
        assert httpx.get(f"{server.frontend_url}/info").json()["speculate"] == 4
        client = openai.OpenAI(base_url=f"{server.frontend_url}/v1", api_key="none")
        before = scrape(server)
        for speculative in (False, True):
            completion = client.completions.create(
                model="llm", prompt=prompt, max_tokens=40, temperature=0,
                extra_body={"speculative": speculative})
            assert completion.choices[0].text == expected
            drafted = delta(before, scrape(server), "spec_decode_num_draft_tokens_total")
            assert (drafted > 0) == speculative
