"""The client package (gRPC `Client`, `HTTPClient`, the `tritonlm-client` CLI) against the real
served SmolLM2, checked with transformers' greedy tokens, tokenizer and chat template."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import hf_greedy
from tritonlm_client import Client, HTTPClient, TritonLMError
from tritonlm_client.chat_defaults import CHAT_DEFAULTS

pytestmark = pytest.mark.server

PROMPT = "Once upon a time"
GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CLI = Path(sys.executable).parent / "tritonlm-client"


@pytest.fixture(scope="module", params=["grpc", "http"])
def client(request, smollm2_server):
    if request.param == "http":
        yield HTTPClient(smollm2_server.http_url)
    else:
        with Client(smollm2_server.grpc_url) as grpc_client:
            yield grpc_client


@pytest.fixture(scope="module")
def reference(smollm2_hf, smollm2_tokenizer):
    """PROMPT's ids, transformers' greedy continuation and its decoded text."""
    ids = smollm2_tokenizer.encode(PROMPT)
    tokens = hf_greedy(smollm2_hf, ids, GREEDY["max_tokens"])
    return ids, tokens, smollm2_tokenizer.decode(tokens, skip_special_tokens=True)


def test_generate_matches_transformers_greedy(client, reference):
    ids, tokens, text = reference
    result = client.generate(PROMPT, **GREEDY)
    assert result.token_ids == tokens
    assert result.text == text
    assert result.finish_reason == "length"
    assert (result.num_input_tokens, result.num_output_tokens) == (len(ids), len(tokens))
    assert client.generate(ids, **GREEDY).token_ids == tokens  # token ids as the prompt


def test_stream_deltas_add_up_to_the_greedy_completion(client, reference):
    _, tokens, text = reference
    deltas = list(client.stream(PROMPT, **GREEDY))
    assert len(deltas) > 1
    assert "".join(d.text for d in deltas) == text
    assert [t for d in deltas for t in d.token_ids] == tokens
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]


def test_chat_uses_the_chat_template_and_answers(client, smollm2_tokenizer):
    rendered = smollm2_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                     return_dict=False)
    result = client.chat(QUESTION, temperature=0, max_tokens=40)
    assert result.num_input_tokens == len(rendered)
    assert "Paris" in result.text
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] == smollm2_tokenizer.eos_token_id
    streamed = list(client.chat_stream(QUESTION, temperature=0, max_tokens=40))
    assert "".join(d.text for d in streamed) == result.text


@pytest.mark.parametrize("sampling, field", [({"top_p": 1.5}, "top_p"),
                                             ({"max_tokens": 0}, "max_tokens"),
                                             ({"no_such_key": 1}, "no_such_key")])
def test_validation_error_names_the_field_and_client_stays_usable(client, sampling, field):
    with pytest.raises(TritonLMError, match=field):
        client.generate(PROMPT, **sampling)
    with pytest.raises(TritonLMError, match=field):
        list(client.stream(PROMPT, **sampling))
    assert client.generate(PROMPT, temperature=0, max_tokens=2).num_output_tokens == 2


def _wait_for_aborts(server, count: int, timeout: float = 10.0) -> int:
    """How many requests the server logged as aborted, once that reaches `count` (or timeout).
    A request that was not cancelled ends with reason=length instead."""
    deadline = time.monotonic() + timeout
    while (seen := server.logs().count("reason=abort")) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def test_closing_a_stream_early_cancels_the_request(client, smollm2_server, reference):
    long = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
    aborted = smollm2_server.logs().count("reason=abort")
    for n, _ in enumerate(client.stream(PROMPT, **long)):
        if n == 2:
            break  # the unnamed generator is closed as the loop drops it
    assert _wait_for_aborts(smollm2_server, aborted + 1) == aborted + 1
    deltas = client.stream(PROMPT, **long)
    next(deltas)
    deltas.close()
    assert _wait_for_aborts(smollm2_server, aborted + 2) == aborted + 2
    assert client.generate(PROMPT, **GREEDY).token_ids == reference[1]


def cli(*args: str, stdin: str | None = None) -> str:
    proc = subprocess.run([str(CLI), *args], input=stdin, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cli_generate_prints_the_greedy_text(smollm2_server):
    with Client(smollm2_server.grpc_url) as grpc_client:
        expected = grpc_client.generate(PROMPT, max_tokens=8, temperature=0).text
    options = ("--max-tokens", "8", "--temperature", "0")
    grpc, http = ("--url", smollm2_server.grpc_url), ("--http", "--url", smollm2_server.http_url)
    assert cli("generate", PROMPT, *grpc, *options) == expected + "\n"
    assert cli("generate", PROMPT, *grpc, *options, "--stream") == expected + "\n"
    assert cli("generate", PROMPT, *http, *options) == expected + "\n"
    assert cli("generate", PROMPT, *http, *options, "--stream") == expected + "\n"


def test_cli_chat_answers_each_stdin_line_and_exits_on_eof(smollm2_server):
    # the keys the user leaves unset start from the chat settings (SmolLM2 gives none)
    sampling = {**CHAT_DEFAULTS, "temperature": 0, "max_tokens": 30}
    follow_up = "And of Germany?"
    with Client(smollm2_server.grpc_url) as grpc_client:
        first = grpc_client.chat(QUESTION, **sampling).text
        history = QUESTION + [{"role": "assistant", "content": first},
                              {"role": "user", "content": follow_up}]
        second = grpc_client.chat(history, **sampling).text
    out = cli("chat", "--url", smollm2_server.grpc_url, "--max-tokens", "30", "--temperature", "0",
              stdin=f"{QUESTION[0]['content']}\n{follow_up}\n")
    assert "Paris" in first
    assert out == f"{first}\n{second}\n"


def test_n_sequences_come_back_as_texts(client):
    sampling = {"temperature": 1.2, "seed": 3, "max_tokens": 6, "n": 3, "ignore_eos": True}
    whole = client.generate("Name a fruit:", **sampling)
    assert len(whole.texts) == 3 and whole.text == whole.texts[0]
    assert whole.num_output_tokens == 18 and len(whole.token_ids) == 18
    assert whole.finish_reason == "length"


def test_sampling_defaults_come_from_the_model_config(client):
    assert client.sampling_defaults() == {}  # SmolLM2's generation_config sets none


def test_model_config_defaults_are_parsed_from_its_parameters():
    from tritonlm_client._core import defaults_from_parameters
    parameters = {"dtype": {"string_value": "float32"}, "default_temperature": {"string_value": "0.6"},
                  "default_top_k": {"string_value": "20"}, "default_bad": {"string_value": "x"}}
    assert defaults_from_parameters(parameters) == {"temperature": 0.6, "top_k": 20}


def test_chat_settings_leave_the_models_own_defaults_to_the_server(capsys):
    from tritonlm_client.cli import _chat_sampling, build_parser

    class ModelWithDefaults:
        def sampling_defaults(self):
            return {"temperature": 0.6, "top_p": 0.95}

    args = build_parser().parse_args(["chat", "--max-tokens", "20", "--top-p", "0.5"])
    sent = _chat_sampling(ModelWithDefaults(), args, show=True)
    # the user's keys, and chat defaults for what neither the user nor the model sets
    assert sent == {"max_tokens": 20, "top_p": 0.5, "top_k": CHAT_DEFAULTS["top_k"],
                    "repetition_penalty": CHAT_DEFAULTS["repetition_penalty"]}
    shown = capsys.readouterr().err
    assert shown.startswith("[settings: ") and "temperature=0.6 (the model's)" in shown
    assert "top_p=0.5 max_tokens=20 (given)" in shown
