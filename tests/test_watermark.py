"""TGI's watermark: green lists as TGI draws them (an independent reimplementation here), text
generated with the watermark detected (z > 4 over 200 tokens) and text without it not (|z| < 2),
unwatermarked requests of the same batch untouched, and the detector's command line; served
through the TGI API and the Triton key."""
import dataclasses
import json
import math
import subprocess
import sys

import httpx
import pytest
import torch
from huggingface_hub import InferenceClient
from transformers import AutoConfig

from tritonlm import LLM, SamplingParams
from tritonlm.engine.llm_engine import resolve_model_dir
from tritonlm.watermark import GreenLists, detect, score

TGI_HASH_KEY = 15485863
PROMPTS = ["Write a story about a dragon who learns to paint.",
           "Explain how rain forms, for a child."]
TOKENS = 200
SERVED_TOKENS = 120


def tgi_green_ids(previous: int, vocab_size: int, gamma: float) -> set[int]:
    """TGI's WatermarkLogitsProcessor._get_greenlist_ids, rewritten from its description."""
    rng = torch.Generator(device="cpu")
    rng.manual_seed(TGI_HASH_KEY * previous)
    permutation = torch.randperm(vocab_size, generator=rng)
    return set(permutation[:int(vocab_size * gamma)].tolist())


def tgi_z_score(token_ids: list[int], vocab_size: int, gamma: float) -> float:
    """The paper's z over the distinct (previous, token) bigrams."""
    bigrams = set(zip(token_ids, token_ids[1:]))
    green = sum(t in tgi_green_ids(p, vocab_size, gamma) for p, t in bigrams)
    return (green - gamma * len(bigrams)) / math.sqrt(len(bigrams) * gamma * (1 - gamma))


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


@pytest.mark.parametrize("gamma", [0.5, 0.25])
def test_green_lists_are_tgis_through_cache_hits_and_evictions(gamma):
    lists = GreenLists(vocab_size=1000, gamma=gamma, device=torch.device("cpu"), capacity=3)
    for previous in ([5, 7, 5, 999], [8, 9, 5, 5, 0], [7, 7], [3, 4, 6, 7, 8, 9]):
        masks = lists.masks_for(previous)
        assert masks.shape == (len(previous), 1000) and masks.dtype == torch.bool
        for row, token in zip(masks, previous):
            assert set(row.nonzero().flatten().tolist()) == tgi_green_ids(token, 1000, gamma)


def test_score_counts_tgis_green_tokens_once_per_bigram():
    ids = [5, 9, 5, 9, 5, 9, 17, 3, 3, 3, 400, 21]
    result = score(ids, 1000, 0.5)
    assert result["scored_tokens"] == len(set(zip(ids, ids[1:])))
    assert result["z_score"] == pytest.approx(tgi_z_score(ids, 1000, 0.5))
    assert result["p_value"] == pytest.approx(0.5 * math.erfc(result["z_score"] / math.sqrt(2)))


@pytest.fixture(scope="module")
def generations(smollm2_repo, smollm2_tokenizer):
    """Each prompt sampled with and without the watermark in one batch, and the start of the
    unmarked ones alone (a request's draws depend only on its seed and step)."""
    llm = LLM(str(smollm2_repo), dtype="auto")
    prompts = [chat(smollm2_tokenizer, p) for p in PROMPTS]

    def params(watermark: bool, seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=TOKENS, ignore_eos=True,
                              watermark=watermark)
    mixed = llm.generate(prompts * 2, [params(True, i) for i in range(2)]
                         + [params(False, i) for i in range(2)])
    alone = llm.generate(prompts, [dataclasses.replace(params(False, i), max_tokens=32)
                                   for i in range(2)])
    return ([o.token_ids for o in mixed[:2]], [o.token_ids for o in mixed[2:]],
            [o.token_ids for o in alone], llm)


def test_watermarked_text_is_detected_and_plain_text_is_not(generations, smollm2_tokenizer):
    marked, plain, _, llm = generations
    vocab = llm.engine.hf_config.vocab_size
    for ids in marked:
        assert len(ids) == TOKENS and tgi_z_score(ids, vocab, 0.5) > 4
    for ids in plain:
        assert abs(tgi_z_score(ids, vocab, 0.5)) < 2


def test_watermarked_rows_leave_the_others_of_their_batch_alone(generations):
    _, plain, alone, _ = generations
    assert [ids[:32] for ids in plain] == alone


def test_detector_command_reads_the_models_gamma(generations, smollm2_repo, smollm2_tokenizer,
                                                 tmp_path):
    marked, plain, _, _ = generations
    path = tmp_path / "text.txt"
    path.write_text(smollm2_tokenizer.decode(marked[0]))
    out = subprocess.run([sys.executable, "-m", "tritonlm.watermark", "detect", "--model",
                          str(smollm2_repo), str(path)], check=True, capture_output=True, text=True)
    result = json.loads(out.stdout)
    assert result["gamma"] == 0.5 and result["z_score"] > 4 and result["p_value"] < 1e-4
    assert abs(detect(smollm2_repo, smollm2_tokenizer.decode(plain[0]))["z_score"]) < 2


def test_engine_gamma_and_delta_apply(smollm2_repo, smollm2_tokenizer):
    llm = LLM(str(smollm2_repo), dtype="auto", watermark_gamma=0.25, watermark_delta=4.0)
    prompt = chat(smollm2_tokenizer, PROMPTS[0])
    ids = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=120,
                                                ignore_eos=True, watermark=True))[0].token_ids
    vocab = llm.engine.hf_config.vocab_size
    assert tgi_z_score(ids, vocab, 0.25) > 4


def test_served_watermark_through_tgi_and_triton(smollm2_server, grpc, smollm2_repo):
    vocab = AutoConfig.from_pretrained(resolve_model_dir(smollm2_repo) / "weights").vocab_size
    hf = InferenceClient(base_url=smollm2_server.frontend_url, timeout=300)
    assert hf.text_generation(PROMPTS[0], max_new_tokens=4, watermark=True)  # the client's key
    # The same through the API with ignore_eos (the front end's extension), for a full length.
    body = {"inputs": PROMPTS[0], "parameters": {
        "max_new_tokens": SERVED_TOKENS, "do_sample": True, "seed": 5, "watermark": True,
        "ignore_eos": True, "details": True}}
    reply = httpx.post(f"{smollm2_server.frontend_url}/generate", json=body, timeout=300)
    ids = [t["id"] for t in reply.raise_for_status().json()["details"]["tokens"]]
    assert len(ids) == SERVED_TOKENS and tgi_z_score(ids, vocab, 0.5) > 4
    served = grpc.generate(PROMPTS[1], max_tokens=SERVED_TOKENS, temperature=1.0, seed=5,
                           ignore_eos=True, watermark=True)
    assert tgi_z_score(served.token_ids, vocab, 0.5) > 4
