"""Generation controls on SmolLM2 against transformers: logprobs, penalties, min_tokens,
bad words, stop strings and stop token ids."""
import pytest
import torch

from tritonlm import SamplingParams

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def chat_prompt(smollm2_tokenizer):
    return smollm2_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                 return_dict=False)


def hf_generate(model, prompt, **kwargs):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def test_logprobs_equal_log_softmax_of_transformers_logits(smollm2_llm, smollm2_hf, chat_prompt):
    # greedy rows without logprobs first: the engine keeps their sampling tensors per row count
    smollm2_llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=2))
    out, = smollm2_llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=12,
                                                              logprobs=5, ignore_eos=True))
    ids = torch.tensor([chat_prompt + out.token_ids])
    with torch.inference_mode():
        logits = smollm2_hf(ids).logits[0].float()
    reference = torch.log_softmax(logits, -1)[len(chat_prompt) - 1:-1]
    assert len(out.logprobs) == 12
    for step, entry in enumerate(out.logprobs):
        assert entry["token_id"] == out.token_ids[step]
        assert entry["logprob"] == pytest.approx(float(reference[step, entry["token_id"]]), abs=1e-4)
        top = torch.topk(reference[step], 5)
        assert [e["token_id"] for e in entry["top_logprobs"]] == top.indices.tolist()
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(
            top.values.tolist(), abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(e["logprob"] for e in out.logprobs), 1e-5)


def test_repetition_penalty_matches_transformers(smollm2_llm, smollm2_hf):
    prompt = smollm2_llm.engine.tokenizer.encode("List the days of the week: Monday, Tuesday,")
    out, = smollm2_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                         repetition_penalty=1.3, ignore_eos=True))
    assert out.token_ids == hf_generate(smollm2_hf, prompt, max_new_tokens=24,
                                        repetition_penalty=1.3, eos_token_id=None)


def test_presence_and_frequency_penalties_follow_openai(smollm2_llm, smollm2_hf):
    prompt = smollm2_llm.engine.tokenizer.encode("Repeat after me: la la la la la la")
    presence, frequency, steps = 0.7, 0.9, 12
    tokens = []
    for _ in range(steps):  # reference: the OpenAI formula on transformers' logits
        with torch.inference_mode():
            logits = smollm2_hf(torch.tensor([prompt + tokens])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(tokens, dtype=torch.int64),
                                minlength=logits.numel()).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        tokens.append(int(logits.argmax()))
    out, = smollm2_llm.generate([prompt], SamplingParams(
        temperature=0, max_tokens=steps, presence_penalty=presence, frequency_penalty=frequency,
        ignore_eos=True))
    assert out.token_ids == tokens


def test_min_tokens_matches_transformers_min_new_tokens(smollm2_llm, smollm2_hf, chat_prompt):
    plain, = smollm2_llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=64))
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 30
    out, = smollm2_llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=40,
                                                              min_tokens=30))
    assert len(out.token_ids) >= 30
    assert out.token_ids == hf_generate(smollm2_hf, chat_prompt, max_new_tokens=40,
                                        min_new_tokens=30)


def test_bad_words_are_never_generated(smollm2_llm, smollm2_hf, smollm2_tokenizer, chat_prompt):
    plain, = smollm2_llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=20))
    assert "4" in plain.text
    variants = [smollm2_tokenizer.encode(w, add_special_tokens=False) for w in ("4", " 4")]
    out, = smollm2_llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=20,
                                                              bad_words=["4"]))
    assert "4" not in out.text
    assert out.token_ids == hf_generate(smollm2_hf, chat_prompt, max_new_tokens=20,
                                        bad_words_ids=variants)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_tokens_match_the_reference_text(smollm2_llm, smollm2_hf,
                                                             smollm2_tokenizer, include):
    prompt = smollm2_tokenizer.encode("The planets of the solar system are Mercury, Venus,")
    reference_ids = hf_generate(smollm2_hf, prompt, max_new_tokens=40, eos_token_id=None)
    reference = smollm2_tokenizer.decode(reference_ids, skip_special_tokens=True)
    stop = smollm2_tokenizer.decode(reference_ids[8:11])  # spans three tokens
    assert stop in reference and len(stop) > 3
    out, = smollm2_llm.generate([prompt], SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=include))
    cut = reference.index(stop) + (len(stop) if include else 0)
    assert out.text == reference[:cut]
    assert out.finish_reason == "stop" and len(out.token_ids) < 40


def test_stop_token_ids_end_generation(smollm2_llm, smollm2_hf, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode("One, two, three,")
    reference = hf_generate(smollm2_hf, prompt, max_new_tokens=20, eos_token_id=None)
    stop_id = reference[5]
    out, = smollm2_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20,
                                                         stop_token_ids=[stop_id],
                                                         ignore_eos=True))
    assert out.token_ids == reference[:reference.index(stop_id) + 1]
    assert out.finish_reason == "stop"


def test_chat_rendering_matches_transformers_and_custom_templates(smollm2_llm, smollm2_tokenizer,
                                                                  tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import run_convert
    from family_check import save_tiny
    from tritonlm import LLM
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]
    for add in (True, False):
        assert smollm2_llm.engine.request_builder.render_chat(messages, add) == smollm2_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    # The template is the converter's business, not the weights': a tiny model carries it.
    save_tiny(tmp_path / "hf", LlamaForCausalLM, LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        vocab_size=len(smollm2_tokenizer)), smollm2_tokenizer)
    model_dir = run_convert(tmp_path / "hf", tmp_path / "repo", "--chat-template", str(template))
    custom = LLM(str(model_dir), num_kv_blocks=16)
    assert custom.engine.request_builder.render_chat(messages[:2]) == "[system] Be brief.\n[user] Hi!\n[assistant] "
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    import subprocess
    with __import__("pytest").raises(subprocess.CalledProcessError) as failure:
        run_convert(tmp_path / "hf", tmp_path / "repo2", "--chat-template",
                    str(tmp_path / "broken.jinja"))
    assert "chat template" in failure.value.stderr


def test_skip_special_tokens(smollm2_llm, smollm2_tokenizer, chat_prompt):
    params = dict(temperature=0, max_tokens=64)
    kept, = smollm2_llm.generate([chat_prompt], SamplingParams(skip_special_tokens=False, **params))
    skipped, = smollm2_llm.generate([chat_prompt], SamplingParams(**params))
    assert kept.finish_reason == "stop" and kept.token_ids == skipped.token_ids
    assert kept.text == smollm2_tokenizer.decode(kept.token_ids, skip_special_tokens=False)
    assert kept.text.endswith(smollm2_tokenizer.eos_token)
    assert skipped.text == smollm2_tokenizer.decode(kept.token_ids, skip_special_tokens=True)


def test_stop_token_ids_outside_the_vocabulary_are_refused(smollm2_llm):
    from tritonlm.errors import InvalidRequestError
    vocab = smollm2_llm.engine.vocab_size
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids \[%d\] are outside" % vocab):
        smollm2_llm.engine.make_request("x", [1, 2], SamplingParams(stop_token_ids=[vocab],
                                                                   min_tokens=1))
