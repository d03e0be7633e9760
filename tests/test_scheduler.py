"""Block manager and scheduler, torch-free: continuous batching, token budget, preemption."""
import sys

import pytest

from tritonlm.config import EngineConfig
from tritonlm.engine.block_manager import BlockManager
from tritonlm.engine.scheduler import Scheduler
from tritonlm.engine.sequence import FinishReason, Sequence, SequenceStatus
from tritonlm.engine.step_plan import SampledToken
from tritonlm.sampling_params import SamplingParams

EOS = 0


def make_seq(seq_id, prompt_len, max_tokens=100, **params):
    p = SamplingParams(max_tokens=max_tokens, temperature=0, **params)
    return Sequence(seq_id, f"r{seq_id}", list(range(1, prompt_len + 1)), p, seed=seq_id,
                    max_total_tokens=prompt_len + max_tokens)


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, prefix_caching=False,
                   headroom_blocks=EngineConfig.admission_headroom_blocks):
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    return Scheduler(bm, max_num_seqs, budget, frozenset({EOS}),
                     headroom_blocks=headroom_blocks), bm


def run_step(sched, token=7):
    plan = sched.schedule()
    sampled = {c.seq_id: SampledToken(token, -1.0, []) for c in plan.chunks if c.sampling is not None}
    sched.update(plan, sampled)
    return plan


def test_block_manager_allocates_frees_and_counts_refs():
    bm = BlockManager(4, 4)
    seq = make_seq(0, 6)
    assert bm.num_missing_blocks(seq, 6) == 2
    bm.grow(seq, 6)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    assert all(bm.ref_counts[b] == 1 for b in seq.block_table)
    seq.num_computed_tokens = 6
    assert bm.num_missing_blocks(seq, 2) == 0  # slots 6 and 7 fit in the second block
    assert bm.num_missing_blocks(seq, 3) == 1
    other = make_seq(1, 12)
    assert not bm.can_grow(other, 12)
    with pytest.raises(RuntimeError):
        bm.grow(other, 12)
    blocks = list(seq.block_table)
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 4
    assert all(bm.ref_counts[b] == 0 for b in blocks)


def test_new_requests_join_the_running_batch_at_the_next_step():
    sched, _ = make_scheduler()
    a = make_seq(0, 5)
    sched.add(a)
    plan = run_step(sched)
    assert [(c.seq_id, len(c.token_ids), c.start_pos) for c in plan.chunks] == [(0, 5, 0)]
    b = make_seq(1, 3)
    sched.add(b)
    plan = run_step(sched)
    assert [(c.seq_id, len(c.token_ids), c.start_pos) for c in plan.chunks] == [(0, 1, 5), (1, 3, 0)]
    assert all(c.sampling is not None for c in plan.chunks)
    assert a.num_output_tokens == 2 and b.num_output_tokens == 1


def test_finished_sequences_leave_at_once_and_free_blocks():
    sched, bm = make_scheduler()
    a, b = make_seq(0, 4, max_tokens=1), make_seq(1, 4, max_tokens=3)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert a.is_finished and a.finish_reason == FinishReason.LENGTH and a.block_table == []
    assert sched.running == [b]
    run_step(sched, token=EOS)
    assert b.finish_reason == FinishReason.STOP
    assert not sched.has_unfinished and bm.num_free_blocks == bm.num_blocks


def test_eos_respects_min_tokens_and_ignore_eos():
    sched, _ = make_scheduler()
    a = make_seq(0, 4, min_tokens=2)
    b = make_seq(1, 4, ignore_eos=True, max_tokens=3)
    sched.add(a)
    sched.add(b)
    run_step(sched, token=EOS)
    assert not a.is_finished and not b.is_finished
    run_step(sched, token=EOS)
    assert a.finish_reason == FinishReason.STOP
    run_step(sched, token=EOS)
    assert b.finish_reason == FinishReason.LENGTH and b.num_output_tokens == 3


def test_token_budget_chunks_long_prompts():
    sched, _ = make_scheduler(num_blocks=32, budget=8)
    running = make_seq(0, 4)
    sched.add(running)
    run_step(sched)
    long = make_seq(1, 20)
    sched.add(long)
    plan = run_step(sched)
    assert [(c.seq_id, len(c.token_ids)) for c in plan.chunks] == [(0, 1), (1, 7)]
    assert plan.chunks[1].sampling is None and long.num_output_tokens == 0
    plan = run_step(sched)
    assert [(c.seq_id, len(c.token_ids), c.start_pos) for c in plan.chunks] == [(0, 1, 5), (1, 7, 7)]
    plan = run_step(sched)
    assert [(c.seq_id, len(c.token_ids), c.start_pos) for c in plan.chunks] == [(0, 1, 6), (1, 6, 14)]
    assert plan.chunks[1].sampling is not None and long.num_output_tokens == 1


def test_preemption_evicts_the_most_recent_and_recomputes_it_later():
    sched, bm = make_scheduler(num_blocks=4, block_size=4, headroom_blocks=0)
    a, b = make_seq(0, 8), make_seq(1, 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 full blocks each
    assert bm.num_free_blocks == 0
    plan = run_step(sched)  # a needs a third block: b (admitted last) is preempted
    assert plan.preempted_seq_ids == [1]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert sched.waiting[0] is b and b.num_output_tokens == 1  # its generated token is kept
    assert [c.seq_id for c in plan.chunks] == [0]
    sched.finish(a, FinishReason.ABORT)
    plan = run_step(sched)
    chunk, = plan.chunks
    assert chunk.seq_id == 1 and len(chunk.token_ids) == 9 and chunk.start_pos == 0
    assert b.num_output_tokens == 2


def test_a_request_waits_while_the_running_ones_lack_room_to_grow():
    sched, bm = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_seq(0, 8, max_tokens=3), make_seq(1, 8, max_tokens=3)
    sched.add(a)
    sched.add(b)
    plan = run_step(sched)  # b's prompt would fit, but then a could not grow
    assert [c.seq_id for c in plan.chunks] == [0] and sched.waiting[0] is b
    assert sched.blocked_by_cache
    while not a.is_finished:
        assert [c.seq_id for c in run_step(sched).chunks] == [0]
    plan = run_step(sched)  # nothing runs: b starts
    assert [(c.seq_id, len(c.token_ids)) for c in plan.chunks] == [(1, 8)]
    while not b.is_finished:
        run_step(sched)
    assert a.num_output_tokens == b.num_output_tokens == 3 and sched.num_preemptions == 0
    assert bm.num_free_blocks == 4


def test_the_headroom_kept_stops_at_each_sequence_token_limit():
    sched, bm = make_scheduler(num_blocks=6, block_size=4)
    a, b = make_seq(0, 8, max_tokens=4), make_seq(1, 4, max_tokens=4)
    sched.add(a)
    sched.add(b)
    # a can still use one block more, b two in all: both fit in the six (2 blocks of headroom
    # each regardless of their limits would have kept b waiting)
    plan = run_step(sched)
    assert [c.seq_id for c in plan.chunks] == [0, 1]
    while not (a.is_finished and b.is_finished):
        run_step(sched)
    assert sched.num_preemptions == 0 and bm.num_free_blocks == 6


def test_a_sequence_larger_than_the_cache_finishes_with_length():
    sched, bm = make_scheduler(num_blocks=2, block_size=4)
    seq = make_seq(0, 7)
    sched.add(seq)
    for _ in range(5):
        run_step(sched)
        if seq.is_finished:
            break
    assert seq.finish_reason == FinishReason.LENGTH and seq.num_tokens == 9
    assert bm.num_free_blocks == 2


def test_max_num_seqs_limits_the_batch():
    sched, _ = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(i, 2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    plan = run_step(sched)
    assert [c.seq_id for c in plan.chunks] == [0, 1]
    sched.finish(seqs[0], FinishReason.ABORT)
    plan = run_step(sched)
    assert [c.seq_id for c in plan.chunks] == [1, 2]


def test_engine_core_imports_no_torch():
    import subprocess
    code = ("import sys; import tritonlm.engine.scheduler, tritonlm.engine.block_manager, "
            "tritonlm.engine.sequence; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def check_block_invariants(sched, bm):
    """Every block's reference count equals the tables holding it; referenced blocks are never
    free, and only free or referenced blocks exist."""
    holders = {}
    for seq in [*sched.running, *sched.waiting]:
        for block in seq.block_table:
            holders[block] = holders.get(block, 0) + 1
    for block in range(bm.num_blocks):
        assert bm.ref_counts[block] == holders.get(block, 0)
        assert (block in bm.free_blocks) == (bm.ref_counts[block] == 0)


def test_prefix_cache_reuses_full_blocks_of_a_finished_request():
    sched, bm = make_scheduler(prefix_caching=True)
    first = make_seq(0, 10, max_tokens=1)
    sched.add(first)
    run_step(sched)
    assert first.is_finished and bm.num_free_blocks == bm.num_blocks
    second = make_seq(1, 13, max_tokens=2)  # same first 10 tokens
    sched.add(second)
    plan = run_step(sched)
    chunk, = plan.chunks
    assert chunk.start_pos == 8 and len(chunk.token_ids) == 5  # two full blocks reused
    assert chunk.block_table[:2] == first_blocks(first, bm)
    assert sched.prefix_cache_hits == 8 and sched.prefix_cache_queries == 10 + 13


def test_requests_arriving_together_compute_a_shared_prefix_once():
    sched, bm = make_scheduler(num_blocks=32, prefix_caching=True)
    first, same, other = make_seq(0, 13, max_tokens=2), make_seq(1, 13, max_tokens=2), \
        Sequence(2, "r2", list(range(50, 63)), SamplingParams(max_tokens=2), seed=2,
                 max_total_tokens=15)
    for seq in (first, same, other):
        sched.add(seq)
    plan = run_step(sched)
    # `same` waits for the three prefix blocks `first` is computing; `other` queues behind it.
    assert [c.seq_id for c in plan.chunks] == [0]
    plan = run_step(sched)
    assert [(c.seq_id, c.start_pos) for c in plan.chunks] == [(0, 13), (1, 12), (2, 0)]
    assert plan.chunks[1].block_table[:3] == plan.chunks[0].block_table[:3]
    assert sched.prefix_cache_hits == 12


def first_blocks(seq, bm):
    return [bm.cached_blocks[h] for h in _hashes(seq.token_ids[:8], bm.block_size)]


def _hashes(tokens, block_size):
    hashes, previous = [], None
    for start in range(0, len(tokens), block_size):
        previous = hash((previous, tuple(tokens[start:start + block_size])))
        hashes.append(previous)
    return hashes


def test_eviction_never_touches_referenced_blocks():
    sched, bm = make_scheduler(num_blocks=12, block_size=4, prefix_caching=True, budget=16,
                               headroom_blocks=0)
    import random
    rng = random.Random(0)
    seq_id = 0
    for step in range(300):
        if rng.random() < 0.4:
            length = rng.randint(2, 20)
            prefix = [1, 2, 3, 4, 5, 6, 7, 8][:rng.choice([0, 4, 8])]
            seq = make_seq(seq_id, 1, max_tokens=rng.randint(1, 12))
            seq.token_ids = prefix + [rng.randint(10, 99) for _ in range(length)]
            seq.num_prompt_tokens = len(seq.token_ids)
            seq.max_total_tokens = seq.num_tokens + seq.params.max_tokens
            sched.add(seq)
            seq_id += 1
        run_step(sched, token=rng.randint(10, 99))
        check_block_invariants(sched, bm)
    assert sched.prefix_cache_hits > 0 and sched.num_preemptions > 0


def test_sequences_finished_before_an_empty_step_reach_the_next_plan():
    """The runner frees a finished sequence's penalty history when a plan names it; a step with
    nothing to run must not drop the name."""
    sched, _ = make_scheduler()
    seq = make_seq(1, 5)
    sched.add(seq)
    run_step(sched)
    sched.finish(seq, FinishReason.ABORT)
    assert sched.schedule().is_empty
    sched.add(make_seq(2, 5))
    assert sched.schedule().finished_seq_ids == [1]


def test_encoder_prompts_count_against_the_token_budget():
    sched, _ = make_scheduler(num_blocks=64, budget=32)
    seqs = [Sequence(i, f"r{i}", [0], SamplingParams(max_tokens=4), 0, 5,
                     encoder_token_ids=list(range(20))) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    first = sched.schedule()
    assert [c.seq_id for c in first.chunks] == [0]  # 20 + 1 tokens; a second would exceed 32
    assert first.chunks[0].encoder_token_ids == list(range(20))


def run_scheduler(max_decode_run, num_blocks=16):
    bm = BlockManager(num_blocks, 4)
    return Scheduler(bm, 8, 64, frozenset({EOS}), max_decode_run), bm


def apply_run(sched, plan, tokens_per_step):
    """Feed a plan's steps their tokens (one per step, the same for every sequence)."""
    for token in tokens_per_step:
        sched.update(plan, {c.seq_id: SampledToken(token, -1.0, []) for c in plan.chunks})


def test_decode_runs_take_every_running_sequence_for_as_many_steps_as_all_can():
    sched, bm = run_scheduler(max_decode_run=4)
    a, b = make_seq(0, 3, max_tokens=20), make_seq(1, 5, max_tokens=3)
    sched.add(a)
    sched.add(b)
    assert run_step(sched).num_steps == 1  # the prompts
    plan = sched.schedule()  # b may add 2 more tokens: a run of 2 steps
    assert plan.num_steps == 2
    assert [(c.seq_id, len(c.token_ids), c.start_pos) for c in plan.chunks] == [(0, 1, 3),
                                                                              (1, 1, 5)]
    # Slots for both steps are given up front: a's positions 3 and 4 cross into its second block.
    assert [len(c.block_table) for c in plan.chunks] == [2, 2]
    apply_run(sched, plan, [7, 8])
    assert b.is_finished and b.finish_reason == FinishReason.LENGTH
    assert a.token_ids[-3:] == [7, 7, 8] and a.num_computed_tokens == 5
    plan = sched.schedule()
    assert plan.num_steps == 4 and [c.seq_id for c in plan.chunks] == [0]
    assert plan.finished_seq_ids == [1]


def test_a_stop_inside_a_run_drops_the_tokens_after_it():
    sched, bm = run_scheduler(max_decode_run=4)
    a, b = make_seq(0, 3), make_seq(1, 3)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    plan = sched.schedule()
    assert plan.num_steps == 4
    sched.update(plan, {0: SampledToken(7, -1.0, []), 1: SampledToken(EOS, -1.0, [])})
    apply_run(sched, plan, [7, 7, 7])
    assert b.is_finished and b.output_token_ids == [7, EOS] and b.block_table == []
    assert a.output_token_ids == [7] * 5 and a.num_computed_tokens == 7
    assert bm.num_free_blocks == 16 - 2


@pytest.mark.parametrize("params", [
    {"presence_penalty": 0.5}, {"min_tokens": 3}, {"watermark": True},
    {"structured_outputs": {"regex": "[a-z]+"}}], ids=str)
def test_sequences_sampled_by_host_state_decode_one_step_at_a_time(params):
    sched, _ = run_scheduler(max_decode_run=4)
    sched.add(make_seq(0, 3))
    sched.add(make_seq(1, 3, **params))
    run_step(sched)
    assert sched.schedule().num_steps == 1


def test_decode_runs_wait_for_requests_to_join_and_for_free_blocks():
    sched, _ = run_scheduler(max_decode_run=4, num_blocks=3)
    sched.add(make_seq(0, 4))
    run_step(sched)
    sched.add(make_seq(1, 9))  # three blocks: it waits for them
    plan = sched.schedule()
    assert plan.num_steps == 1 and [c.seq_id for c in plan.chunks] == [0] and sched.waiting

    sched, bm = run_scheduler(max_decode_run=4, num_blocks=2)
    a = make_seq(0, 3)
    sched.add(a)
    run_step(sched)
    bm.grow(make_seq(1, 4), 4)  # the other block held: a's position 3 fits, 4 to 6 would not
    plan = sched.schedule()
    assert plan.num_steps == 1 and plan.chunks[0].block_table == a.block_table[:1]


def test_a_full_batch_runs_while_requests_wait_for_a_slot():
    sched = Scheduler(BlockManager(16, 4), 2, 64, frozenset({EOS}), max_decode_run=4)
    for i in range(3):
        sched.add(make_seq(i, 3, max_tokens=5))
    run_step(sched)  # two prompts; the third waits for a slot
    plan = sched.schedule()
    assert plan.num_steps == 4 and [c.seq_id for c in plan.chunks] == [0, 1]
    apply_run(sched, plan, [7, 7, 7, 7])
    plan = sched.schedule()  # both ended (5 tokens): the third joins
    assert plan.num_steps == 1 and [c.seq_id for c in plan.chunks] == [2]
