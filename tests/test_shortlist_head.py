"""A draft model's shortlist head (layers/shortlist_head.py, csrc/shortlist_argmax.cpp): the
kernel against torch (the k largest cheap logits, the first ids among equals, rescored exactly),
and the head on SmolLM2's own head and transformers' hidden states against transformers' greedy
tokens."""
import pytest
import torch

from tritonlm.layers import cpu_kernels
from tritonlm.layers.shortlist_head import SHORTLIST, ShortlistHead

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernels():
    return cpu_kernels.build()  # raises with the compiler's output if it cannot build


def reference(approx: torch.Tensor, hidden: torch.Tensor, head: torch.Tensor, k: int):
    """torch: the k largest of each row of approx (a stable sort: the first ids among equals),
    then the one of them whose head row scores highest against hidden."""
    shortlist = torch.sort(-approx.float(), dim=-1, stable=True).indices[:, :k]
    scores = (head[shortlist].float() * hidden.float()[:, None, :]).sum(-1)
    return shortlist.gather(1, scores.argmax(-1, keepdim=True))[:, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,k", [(1000, 1), (1000, 5), (1003, 16), (7, 16)])
def test_picks_the_best_scored_of_the_k_largest(kernels, dtype, vocab, k):
    seeded = torch.Generator().manual_seed(vocab + k)
    hidden = torch.randn(3, 72, generator=seeded).to(dtype)
    head = torch.randn(vocab, 72, generator=seeded).to(dtype)
    # cheap logits that disagree with the exact ones: the shortlist decides
    approx = (hidden.float() @ head.float().T + torch.randn(3, vocab, generator=seeded)).to(dtype)
    tokens = kernels.shortlist_argmax(approx, hidden, head, k)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, reference(approx, hidden, head, k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_keep_the_first_ids_and_rows_may_lie_apart(kernels, dtype):
    seeded = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, 2, 64, generator=seeded).to(dtype)[:, 0]  # rows apart
    head = torch.randn(300, 64, generator=seeded).to(dtype)
    approx = torch.randint(0, 4, (4, 300), generator=seeded).to(dtype)  # many equal values
    assert hidden.stride(0) == 128
    for k in (1, 3, 40):
        assert torch.equal(kernels.shortlist_argmax(approx, hidden, head, k),
                           reference(approx, hidden, head, k))


def test_exact_logits_give_torchs_argmax_and_nan_is_never_shortlisted(kernels):
    seeded = torch.Generator().manual_seed(5)
    hidden, head = torch.randn(2, 48, generator=seeded), torch.randn(500, 48, generator=seeded)
    exact = hidden @ head.T
    assert torch.equal(kernels.shortlist_argmax(exact, hidden, head, 4), exact.argmax(-1))
    approx = exact.clone()
    approx[0, exact[0].argmax()] = float("nan")  # the best token, hidden from the shortlist
    approx[1] = float("nan")
    tokens = kernels.shortlist_argmax(approx, hidden, head, 4)
    assert tokens[0] == reference(torch.nan_to_num(approx[:1], nan=-torch.inf), hidden[:1], head, 4)
    assert tokens[0] != exact[0].argmax() and 0 <= tokens[1] < 500


def test_bad_inputs_are_refused(kernels):
    hidden, head = torch.randn(2, 16), torch.randn(50, 16)
    approx = hidden @ head.T
    for args, message in [((approx[:, :40], hidden, head, 4), "disagree"),
                          ((approx, hidden.double(), head.double(), 4), "share a dtype"),
                          ((approx, hidden.bfloat16(), head, 4), "share a dtype"),
                          ((approx, hidden, head, 0), "k must be positive"),
                          ((approx.T, hidden, head, 4), "contiguous rows")]:
        with pytest.raises(RuntimeError, match=f"shortlist_argmax: .*{message}"):
            kernels.shortlist_argmax(*args)


@pytest.mark.parametrize("int8_inputs", [False, True])
def test_smollm2_shortlist_gives_transformers_greedy_tokens(kernels, smollm2_hf,
                                                            smollm2_tokenizer, int8_inputs):
    """SmolLM2's own head (49,152 x 576) and transformers' final hidden states of chat text: every
    position's token is transformers' argmax, though the 4-bit ranking alone misses some."""
    text = ("The water cycle moves water between the oceans, the air and the land. The sun "
            "warms the sea, water evaporates, rises and cools into clouds; rain and snow fall, "
            "rivers carry it back. Write a short story about a robot learning to paint.")
    ids = torch.tensor([smollm2_tokenizer(text)["input_ids"]])
    with torch.no_grad():
        out = smollm2_hf(ids, output_hidden_states=True)
    hidden, expected = out.hidden_states[-1][0], out.logits[0].argmax(-1)
    weight = smollm2_hf.get_output_embeddings().weight.detach()
    head = ShortlistHead(weight, kernels, int8_inputs)
    assert torch.equal(head(hidden.contiguous()), expected)
    ranked_first = head.rank(hidden.contiguous()).argmax(-1)
    assert (ranked_first != expected).any() and SHORTLIST < weight.shape[0]
