"""Incremental detokenization and stop strings against transformers' own decode of SmolLM2's
tokenizer (loaded by transformers from the GGUF file, independent of our converter)."""
import pytest

from tritonlm.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The answer is 42.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "Emoji: 😀🎉👩‍👩‍👧 and accents: naïve café, Ångström.",
    "def f(x):\n    return x ** 2  # square\n",
]


def stream(tokenizer, prompt_ids, output_ids, stop=(), include_stop=False):
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, prompt_ids, True, list(stop),
                                   include_stop)
    ids = list(prompt_ids)
    deltas = []
    for i, token in enumerate(output_ids):
        ids.append(token)
        final = i == len(output_ids) - 1
        matched = detok.add_tokens(ids, final=final)
        deltas.append(detok.take_delta(finished=final or matched))
        if matched:
            break
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_equal_full_decode_and_never_break_utf8(smollm2_tokenizer, text):
    prompt = smollm2_tokenizer.encode("Translate: ")
    output = smollm2_tokenizer.encode(text)
    deltas = stream(smollm2_tokenizer, prompt, output)
    assert "".join(deltas) == smollm2_tokenizer.decode(output, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)
    assert len(output) > len(text.encode()) // 4  # multi-byte characters span several tokens


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("stop", ["world", "is 4", "。今天", "😀🎉"])
def test_stop_strings_across_tokens(smollm2_tokenizer, stop, include_stop):
    text = next(t for t in TEXTS if stop in t)
    output = smollm2_tokenizer.encode(text)
    deltas = stream(smollm2_tokenizer, [], output, stop=[stop], include_stop=include_stop)
    full = smollm2_tokenizer.decode(output)
    cut = full.index(stop) + (len(stop) if include_stop else 0)
    assert "".join(deltas) == full[:cut]
    assert len(deltas) < len(output)  # generation stopped at the match
    # nothing that could still become the stop string was emitted early
    emitted = ""
    for delta in deltas[:-1]:
        emitted += delta
        assert not any(stop.startswith(emitted[i:]) for i in range(len(emitted)))


def test_held_back_text_is_released_when_it_cannot_become_a_stop(smollm2_tokenizer):
    output = smollm2_tokenizer.encode("Hello, world! The answer is 42.")
    deltas = stream(smollm2_tokenizer, [], output, stop=["worldwide"])
    assert "".join(deltas) == smollm2_tokenizer.decode(output)


@pytest.mark.parametrize("group", [3, 1000])
@pytest.mark.parametrize("text", TEXTS)
def test_tokens_added_in_groups_decode_as_the_whole(smollm2_tokenizer, text, group):
    """Text with no stop strings to watch is decoded when output is due (a non-streamed request:
    once, at the end): several new tokens at a time, cut anywhere in a character."""
    prompt = smollm2_tokenizer.encode("Translate: ")
    output = smollm2_tokenizer.encode(text)
    detok = IncrementalDetokenizer(smollm2_tokenizer.backend_tokenizer, prompt, True, [], False)
    deltas = []
    for end in range(group, len(output) + group, group):
        final = end >= len(output)
        assert not detok.add_tokens(prompt + output[:end], final=final)
        assert not detok.add_tokens(prompt + output[:end], final=final)  # nothing new: no-op
        deltas.append(detok.take_delta(finished=final))
    assert "".join(deltas) == smollm2_tokenizer.decode(output, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)
