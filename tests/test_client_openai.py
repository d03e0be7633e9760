"""`OpenAIClient` and `tritonlm-client --openai` through the real HTTP front end (started by
tritonlm-serve beside the real tritonserver): greedy text equal to gRPC's, chat with the chat
settings, errors, cancellation."""
import pytest

from test_client import CLI, PROMPT, QUESTION, _wait_for_aborts, cli  # noqa: F401
from tritonlm_client import OpenAIClient, TritonLMError
from tritonlm_client.chat_defaults import CHAT_DEFAULTS

pytestmark = pytest.mark.server

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def openai(smollm2_server):
    return OpenAIClient(smollm2_server.frontend_url)


def test_greedy_text_equals_grpc(openai, grpc):
    expected = grpc.generate(PROMPT, **GREEDY)
    result = openai.generate(PROMPT, **GREEDY)
    assert result.text == expected.text
    assert result.finish_reason == "length"
    assert (result.num_input_tokens, result.num_output_tokens) == (
        expected.num_input_tokens, expected.num_output_tokens)
    assert openai.generate(expected.token_ids[:4], **GREEDY).text == grpc.generate(
        expected.token_ids[:4], **GREEDY).text  # token ids as the prompt
    deltas = list(openai.stream(PROMPT, **GREEDY))
    assert len(deltas) > 1 and "".join(d.text for d in deltas) == expected.text
    assert [d.finish_reason for d in deltas][-1] == "length"


def test_without_max_tokens_generation_runs_on_as_over_triton(openai, grpc):
    # The OpenAI API's default for completions is 16 tokens; the client asks for no limit.
    longer = grpc.generate(PROMPT, temperature=0, max_tokens=40, ignore_eos=True).text
    sampling = {"temperature": 0, "ignore_eos": True, "stop": [longer[-12:]]}
    expected = grpc.generate(PROMPT, **sampling)
    assert expected.finish_reason == "stop" and expected.num_output_tokens > 16
    result = openai.generate(PROMPT, **sampling)
    assert (result.text, result.num_output_tokens) == (expected.text, expected.num_output_tokens)


def test_chat_and_n_sequences(openai, grpc):
    expected = grpc.chat(QUESTION, temperature=0, max_tokens=30)
    answer = openai.chat(QUESTION, temperature=0, max_tokens=30)
    assert "Paris" in answer.text and answer.text == expected.text
    assert answer.finish_reason == "stop"
    assert answer.num_input_tokens == expected.num_input_tokens
    streamed = list(openai.chat_stream(QUESTION, temperature=0, max_tokens=30))
    assert "".join(d.text for d in streamed) == expected.text
    sampling = {"temperature": 1.2, "seed": 3, "max_tokens": 6, "n": 2, "ignore_eos": True}
    whole = openai.generate("Name a fruit:", **sampling)
    assert len(whole.texts) == 2 and whole.num_output_tokens == 12
    assert whole.texts == grpc.generate("Name a fruit:", **sampling).texts


def test_a_rejected_request_raises_with_the_servers_message(openai):
    with pytest.raises(TritonLMError, match="top_p"):
        openai.generate(PROMPT, top_p=1.5)
    with pytest.raises(TritonLMError, match="top_p"):
        list(openai.stream(PROMPT, top_p=1.5))
    with pytest.raises(TritonLMError, match="does not exist"):
        OpenAIClient(f"{openai.host}:{openai.port}", model="nope").generate(PROMPT)
    assert openai.generate(PROMPT, temperature=0, max_tokens=2).num_output_tokens == 2


def test_closing_a_stream_early_cancels_the_request(openai, smollm2_server):
    aborted = smollm2_server.logs().count("reason=abort")
    deltas = openai.stream(PROMPT, temperature=0, max_tokens=400, ignore_eos=True)
    next(deltas)
    deltas.close()
    assert _wait_for_aborts(smollm2_server, aborted + 1) == aborted + 1


def test_sampling_defaults_are_the_models(openai):
    assert openai.sampling_defaults() == {}  # SmolLM2's generation_config sets none


def test_cli_generate_through_openai_prints_grpcs_greedy_text(smollm2_server, grpc):
    expected = grpc.generate(PROMPT, max_tokens=8, temperature=0).text
    options = ("--openai", smollm2_server.frontend_url, "--max-tokens", "8", "--temperature", "0")
    assert cli("generate", PROMPT, *options) == expected + "\n"
    assert cli("generate", PROMPT, *options, "--stream") == expected + "\n"


def test_cli_generate_chat_sends_one_user_message_with_the_chat_settings(smollm2_server, grpc):
    given = {"temperature": 0, "max_tokens": 30}
    expected = grpc.chat(QUESTION, **{**CHAT_DEFAULTS, **given}).text
    assert "Paris" in expected
    options = ("--max-tokens", "30", "--temperature", "0")
    question = QUESTION[0]["content"]
    assert cli("generate", "--chat", question, "--url", smollm2_server.grpc_url,
               *options) == expected + "\n"
    assert cli("generate", "--chat", question, "--openai", smollm2_server.frontend_url,
               *options, "--stream") == expected + "\n"


def test_cli_chat_through_openai_answers_each_line_with_the_chat_settings(smollm2_server,
                                                                          grpc):
    import subprocess
    given = {"temperature": 0, "max_tokens": 30}
    sampling = {**CHAT_DEFAULTS, **given}
    follow_up = "And of Germany?"
    first = grpc.chat(QUESTION, **sampling).text
    history = QUESTION + [{"role": "assistant", "content": first},
                          {"role": "user", "content": follow_up}]
    second = grpc.chat(history, **sampling).text
    proc = subprocess.run([str(CLI), "chat", "--openai", smollm2_server.frontend_url,
                           "--max-tokens", "30", "--temperature", "0"],
                          input=f"{QUESTION[0]['content']}\n{follow_up}\n", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{first}\n{second}\n"
    # the settings in use, once, before the first answer
    assert proc.stderr.count("[settings:") == 1
    assert "temperature=0.0 max_tokens=30 (given)" in proc.stderr
    assert f"top_p={CHAT_DEFAULTS['top_p']}" in proc.stderr and "(chat defaults)" in proc.stderr
