"""Penalties, truncations and logprobs of the batched sampler against transformers' logits
processors and warpers (applied row by row with that row's parameters) and OpenAI's penalty
formula; TokenCounts against the token lists it is fed."""
import torch
from test_sampler import tensors
from transformers.generation.logits_process import (
    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper, TypicalLogitsWarper)

from tritonlm.engine.step_plan import ScheduledChunk
from tritonlm.layers.sampler import apply_penalties, sample, truncate
from tritonlm.layers.token_counts import TokenCounts

VOCAB = 500
NO_IDS = torch.zeros((1, 0), dtype=torch.int64)


def random_logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def history(id_lists, outputs_from):
    """seen ([rows, V] bool) over whole lists; counts over list[i][outputs_from[i]:]."""
    seen = torch.zeros(len(id_lists), VOCAB, dtype=torch.bool)
    counts = torch.zeros(len(id_lists), VOCAB, dtype=torch.int32)
    for i, (ids, start) in enumerate(zip(id_lists, outputs_from)):
        seen[i, ids] = True
        counts[i] += bincount(ids[start:])
    return seen, counts


def bincount(ids):
    return torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=VOCAB).int()


def hf_repetition(logits, row, penalty, ids):
    processor = RepetitionPenaltyLogitsProcessor(float(penalty))
    return processor(torch.tensor([ids]), logits[row:row + 1].clone())[0]


def token_lists(rows, length=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=g).tolist() for _ in range(rows)]


def test_repetition_penalty_matches_hf_per_row():
    logits, ids = random_logits(4), token_lists(4)
    penalty = torch.tensor([1.3, 0.8, 1.0, 2.0])
    seen, _ = history(ids, [len(i) for i in ids])  # all "prompt": no output counts
    out = apply_penalties(logits, tensors(4, repetition_penalty=penalty, seen=seen,
                                          output_counts=torch.zeros(4, VOCAB, dtype=torch.int32)))
    for i in range(4):
        expected = hf_repetition(logits, i, penalty[i], ids[i])
        torch.testing.assert_close(out[i], expected, rtol=0, atol=1e-6)
    assert torch.equal(out[2], logits[2])


def test_presence_frequency_penalties_follow_the_openai_formula_over_outputs_only():
    logits, ids = random_logits(4, seed=2), token_lists(4, seed=3)
    prompt_len = [10, 20, 0, 40]  # row 3: nothing generated yet
    seen, counts = history(ids, prompt_len)
    freq, pres = torch.tensor([0.5, -0.3, 1.5, 2.0]), torch.tensor([1.0, 0.0, -0.7, 2.0])
    rep = torch.tensor([1.0, 1.2, 1.0, 1.5])
    out = apply_penalties(logits, tensors(4, repetition_penalty=rep, frequency_penalty=freq,
                                          presence_penalty=pres, seen=seen, output_counts=counts))
    for i in range(4):
        c = bincount(ids[i][prompt_len[i]:]).float()
        expected = hf_repetition(logits, i, rep[i], ids[i]) - freq[i] * c - pres[i] * (c > 0)
        torch.testing.assert_close(out[i], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[3], hf_repetition(logits, 3, rep[3], ids[3]))  # no outputs yet


def kept(x):
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in x]


def hf_rows(logits, warpers):
    """warpers: per row a list of HF warpers applied in order (empty: untouched)."""
    rows = []
    for row, chain in zip(logits, warpers):
        row = row[None].clone()
        for w in chain:
            row = w(NO_IDS, row)
        rows.append(row[0])
    return torch.stack(rows)


def check_truncation(rows, warpers, **params):
    logits = random_logits(rows, seed=4)
    ours = truncate(logits.clone(), tensors(rows, **params))
    assert kept(ours) == kept(hf_rows(logits, warpers))
    finite = torch.isfinite(ours)
    assert torch.equal(ours[finite], logits[finite])  # kept entries are left as they were
    return ours


def test_top_k_per_row():
    warpers = [[TopKLogitsWarper(1)], [TopKLogitsWarper(7)], [], [TopKLogitsWarper(100)]]
    check_truncation(4, warpers, top_k=torch.tensor([1, 7, 0, 100]))


def test_top_p_per_row():
    warpers = [[TopPLogitsWarper(0.5)], [TopPLogitsWarper(0.9)], [], [TopPLogitsWarper(0.01)]]
    ours = check_truncation(4, warpers, top_p=torch.tensor([0.5, 0.9, 1.0, 0.01]))
    assert [len(s) for s in kept(ours)][2:] == [VOCAB, 1]


def test_min_p_per_row():
    check_truncation(3, [[MinPLogitsWarper(0.1)], [], [MinPLogitsWarper(0.5)]],
                     min_p=torch.tensor([0.1, 0.0, 0.5]))


def test_typical_p_per_row():
    warpers = [[TypicalLogitsWarper(m)] if m < 1 else [] for m in (0.5, 0.95, 1.0, 0.2)]
    check_truncation(4, warpers, typical_p=torch.tensor([0.5, 0.95, 1.0, 0.2]))


def test_top_k_and_top_p_in_the_same_row_match_hf_top_k_then_top_p():
    check_truncation(
        5, [[TopKLogitsWarper(20), TopPLogitsWarper(0.8)], [TopKLogitsWarper(5),
            TopPLogitsWarper(0.3)], [TopKLogitsWarper(50)], [TopPLogitsWarper(0.6)], []],
        top_k=torch.tensor([20, 5, 50, 0, 0]), top_p=torch.tensor([0.8, 0.3, 1.0, 0.6, 1.0]))


def test_sampled_tokens_stay_in_hf_temperature_then_top_p_set_and_greedy_rows_take_argmax():
    logits = random_logits(3, seed=5) / 3
    temperature, top_p = [0.0, 0.5, 2.0], [0.7, 0.7, 0.5]
    for i in range(3):
        n = 400  # the same row with n seeds, beside greedy copies
        rows = logits[i].expand(2 * n, -1)
        temp = torch.tensor([temperature[i], 0.0]).repeat_interleave(n)
        out = sample(rows, tensors(2 * n, temperature=temp, top_p=top_p[i],
                                   seeds=torch.arange(2 * n, dtype=torch.int64))).tokens
        assert set(out[n:].tolist()) == {int(logits[i].argmax())}
        if temperature[i] == 0:
            assert set(out[:n].tolist()) == {int(logits[i].argmax())}
        else:
            allowed = kept(hf_rows(logits[i:i + 1], [[TemperatureLogitsWarper(temperature[i]),
                                                      TopPLogitsWarper(top_p[i])]]))[0]
            assert 1 < len(allowed) < VOCAB and 1 < len(set(out[:n].tolist()))
            assert set(out[:n].tolist()) <= allowed


def test_logprobs_are_of_the_raw_distribution():
    logits, ids = random_logits(4, seed=6), token_lists(4, seed=7)
    seen, counts = history(ids, [20] * 4)
    t = tensors(4, temperature=torch.tensor([0.0, 0.7, 1.5, 1.0]), top_k=torch.tensor([0, 10, 0, 3]),
                typical_p=torch.tensor([1.0, 1.0, 0.8, 1.0]), frequency_penalty=0.5,
                repetition_penalty=torch.tensor([1.5, 1.0, 1.2, 1.0]),
                seen=seen, output_counts=counts, num_logprobs=5)
    out = sample(logits, t)
    reference = torch.log_softmax(logits, dim=-1)
    chosen = reference.gather(-1, out.tokens[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs, chosen, rtol=0, atol=1e-5)
    top = torch.topk(reference, 5)
    assert torch.equal(out.top_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values, rtol=0, atol=1e-5)


def chunk(seq_id, token_ids, start_pos, num_prompt, track=True):
    # sampling=None: TokenCounts reads only ids, positions, prompt length and track_tokens
    return ScheduledChunk(seq_id, token_ids, start_pos, [0], None, num_prompt, track)


def expect(tc, seq_id, prompt, outputs, rows=None, row=0):
    """The history of `seq_id` (of row `row` of the sampling `rows`, when given) is `prompt`
    and `outputs`."""
    seen, counts = tc.history(rows or [chunk(seq_id, [0], 0, 0)])
    assert set(seen[row].nonzero().flatten().tolist()) == set(prompt) | set(outputs)
    assert torch.equal(counts[row], bincount(outputs))


def test_token_counts_chunked_prefill_decode_recompute_and_release():
    tc, prompt = TokenCounts(VOCAB, torch.device("cpu")), [5, 7, 7, 9, 11]
    other_prompt, other_outputs = [1, 2, 3], [2, 2, 8, 9]  # seq 4 decodes beside seq 1
    tc.record([chunk(4, other_prompt, 0, 3), chunk(1, prompt[:3], 0, 5),
               chunk(2, [1, 2], 0, 2, track=False)])
    expect(tc, 1, prompt[:3], [])
    tc.record([chunk(1, prompt[3:], 3, 5)])  # the prompt's second chunk
    expect(tc, 1, prompt, [])
    outputs = [7, 3, 7, 400]
    for i, token in enumerate(outputs):  # decode: the token sampled last step, at its position
        tc.record([chunk(4, [other_outputs[i]], 3 + i, 3), chunk(1, [token], 5 + i, 5)])
        expect(tc, 1, prompt, outputs[:i + 1])
        expect(tc, 4, other_prompt, other_outputs[:i + 1])
    tc.record([chunk(1, prompt + outputs[:3], 0, 5)])  # recomputed after preemption, in one chunk
    expect(tc, 1, prompt, outputs[:3])
    tc.record([chunk(1, (prompt + outputs)[:4], 0, 5)])  # ... or in two
    tc.record([chunk(1, (prompt + outputs)[4:], 4, 5)])
    expect(tc, 1, prompt, outputs)
    # untracked and unknown ids give zeros
    seen, counts = tc.history([chunk(i, [0], 0, 0) for i in (2, 99, 1)])
    assert not seen[:2].any() and not counts[:2].any() and seen[2].any()
    row = tc.rows[1]
    tc.release([1])
    expect(tc, 1, [], [])
    tc.record([chunk(3, [8, 9], 0, 1)])
    assert tc.rows[3] == row
    expect(tc, 3, [8], [9])
    expect(tc, 4, other_prompt, other_outputs)


def test_token_counts_of_a_verification_count_each_rows_proposals_before_it():
    """A verification's rows (the input token, then proposals) are counted at once; each row's
    history holds the proposals up to its own input; the next step uncounts the refused ones,
    and a sequence whose next chunk restarts (preempted) recounts from scratch."""
    tc, prompt, outputs = TokenCounts(VOCAB, torch.device("cpu")), [5, 7, 9], [7, 3]
    tc.record([chunk(1, prompt + outputs, 0, 3)])
    last, proposals = 8, [3, 8, 7]
    rows = [chunk(1, [token], 5 + j, 3) for j, token in enumerate([last] + proposals)]
    rows.insert(2, chunk(4, [2], 0, 1))  # another sequence's row in between
    tc.record(rows)
    before_row = [[last] + proposals[:j] for j in range(len(proposals) + 1)]
    for j, row in enumerate([0, 1, 3, 4]):
        expect(tc, 1, prompt, outputs + before_row[j], rows, row)
    expect(tc, 4, [2], [], rows, 2)
    kept, drawn = proposals[:1], 400  # the second proposal refused: 400 stands where it stood
    tc.record([chunk(1, [drawn], 5 + 1 + len(kept), 3)])
    expect(tc, 1, prompt, outputs + [last] + kept + [drawn])
    tc.record([chunk(1, prompt + outputs, 0, 3)])  # a restart after preemption
    expect(tc, 1, prompt, outputs)


def test_top_k_keeps_ties_like_transformers():
    from transformers.generation.logits_process import TopKLogitsWarper
    from tritonlm.layers.sampler import truncate
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    ours = truncate(logits, tensors(1, top_k=2))
    reference = TopKLogitsWarper(2)(None, logits.clone())
    assert torch.isfinite(ours).tolist() == torch.isfinite(reference).tolist()
