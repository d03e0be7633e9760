"""Rebuilding a Hugging Face fast tokenizer from a GGUF file's `tokenizer.*` metadata."""
from gguf import Keys, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .errors import ConversionError

K = Keys.Tokenizer

# Llama 3's split pattern (its tokenizer.json; llama.cpp's "llama3" pre-tokenizer is equivalent).
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool = True) -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _gpt2():
    return _byte_level(), False


def _smollm():
    # SmolLM's tokenizer.json puts every digit in its own word before the GPT-2 split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]), False


def _llama3():
    split = pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence([split, _byte_level(use_regex=False)]), True


# llama.cpp's `tokenizer.ggml.pre` names -> (pre-tokenizer of the original tokenizer.json, ignore_merges).
# Only names whose original pre-tokenizer is known exactly; llama.cpp's "default" is its own regex set.
PRE_TOKENIZERS = {"gpt2": _gpt2, "smollm": _smollm, "llama3": _llama3, "llama-v3": _llama3, "llama-bpe": _llama3}


def _token(meta: dict, key: str) -> str | None:
    index = meta.get(key)
    return None if index is None else meta[K.LIST][index]


def _bpe_backend(meta: dict) -> Tokenizer:
    """A byte-level BPE tokenizer (`tokenizer.ggml.model == "gpt2"`) with the right pre-tokenizer."""
    pre = meta.get(K.PRE, "default")
    if pre not in PRE_TOKENIZERS:
        raise ConversionError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(PRE_TOKENIZERS)}")
    pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]()
    vocab = {token: i for i, token in enumerate(meta[K.LIST])}
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get(K.MERGES, [])]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_merges(tokens: list[str], scores: list[float], mergeable: set[str]) -> list[tuple[str, str]]:
    """BPE merges equivalent to sentencepiece's rule: repeatedly join the adjacent pair whose join is the
    highest-scoring vocabulary piece."""
    ranked = []
    for index, (token, score) in enumerate(zip(tokens, scores)):
        if token in mergeable:
            ranked.extend((-score, index, cut, token[:cut], token[cut:]) for cut in range(1, len(token))
                          if token[:cut] in mergeable and token[cut:] in mergeable)
    return [(left, right) for *_, left, right in sorted(ranked)]


def _spm_backend(meta: dict, types: list[int]) -> Tokenizer:
    """A sentencepiece-style BPE tokenizer (`tokenizer.ggml.model == "llama"`) with byte fallback."""
    if meta.get(K.REMOVE_EXTRA_WS):
        raise ConversionError("GGUF sentencepiece vocabularies that collapse whitespace are not supported")
    tokens = meta[K.LIST]
    mergeable = {t for t, kind in zip(tokens, types) if kind == TokenType.NORMAL}
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = _spm_merges(tokens, meta[K.SCORES], mergeable)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=_token(meta, K.UNK_ID),
                                   fuse_unk=True, byte_fallback=True))
    # llama.cpp prefixes a space to every text fragment (after each special token too), like the
    # Llama tokenizer.json's normalizer does.
    prefix = meta.get(K.ADD_PREFIX, True)
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", int(prefix), 0)])
    return backend


def build_tokenizer(meta: dict, model_max_length: int) -> PreTrainedTokenizerFast:
    """The tokenizer described by GGUF metadata (`meta`: field name -> value)."""
    model = meta.get(K.MODEL)
    tokens = meta[K.LIST]
    types = meta.get(K.TOKEN_TYPE, [TokenType.NORMAL] * len(tokens))
    if model == "gpt2":
        backend = _bpe_backend(meta)
    elif model == "llama":
        backend = _spm_backend(meta, types)
    else:
        raise ConversionError(f"unsupported GGUF tokenizer model {model!r}; supported: gpt2, llama")
    # Control tokens were special in the original tokenizer; user-defined ones were plain added tokens.
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t in (TokenType.CONTROL, TokenType.UNKNOWN)])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == TokenType.USER_DEFINED])
    special = {name: _token(meta, key) for name, key in (
        ("bos_token", K.BOS_ID), ("eos_token", K.EOS_ID), ("unk_token", K.UNK_ID), ("pad_token", K.PAD_ID))}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **{name: token for name, token in special.items() if token is not None},
        add_bos_token=bool(meta.get(K.ADD_BOS, model == "llama")),  # llama.cpp's default per model
        add_eos_token=bool(meta.get(K.ADD_EOS, False)),
        chat_template=meta.get(K.CHAT_TEMPLATE),
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
