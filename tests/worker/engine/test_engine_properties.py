"""Hypothesis drives the engine (block manager + scheduler) with random
add / step / abort / preempt sequences over a tiny pool with shared prompts,
checking block invariants after every operation and no leaks at the end."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.engine_helpers import assert_no_leaks, check_block_invariants, make_engine, request
from worker.engine.scheduler import _Step

PROMPTS = ["hello world hello engine", "hello world hello batching", "fox dog fox dog fox", "paged"]

ops = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort", "preempt"]),
                         st.integers(0, 3), st.integers(1, 8)), max_size=40)


@settings(max_examples=25, deadline=None)
@given(ops, st.integers(8, 14), st.sampled_from(["fcfs", "sjf", "fair"]), st.sampled_from([0, 3]))
def test_random_operations_keep_block_invariants(operations, num_blocks, policy, long_prefill):
    eng = make_engine(num_blocks=num_blocks, max_num_batched_tokens=8, max_num_seqs=4, policy=policy,
                      long_prefill_token_threshold=long_prefill)
    n = 0
    for op, i, k in operations:
        if op == "add":
            r = request(f"r{n}", f"{PROMPTS[i]} {k}", max_tokens=k)
            n += 1
            if eng.scheduler.never_fits(len(r.prompt_token_ids), k) is None:
                assert eng.add_request(r).ok
        elif op == "abort" and eng._groups:
            eng.abort(sorted(eng._groups)[i % len(eng._groups)])
        elif op == "preempt" and eng.scheduler.running:
            eng.scheduler._preempt(eng.scheduler.running[-1], _Step(budget=0))
        else:
            eng.step()
        check_block_invariants(eng.block_manager)
        assert 0.0 <= eng.stats().fragmentation < 1.0
    for _ in range(2000):
        if not eng.has_unfinished():
            break
        eng.step()
        check_block_invariants(eng.block_manager)
    assert_no_leaks(eng)


def test_fragmentation_counts_unused_slots_of_used_blocks():
    eng = make_engine(num_blocks=16, block_size=4, enable_prefix_caching=False)
    eng.add_request(request("a", "fox dog", max_tokens=4))  # 3 tokens in one 4-slot block
    eng.step()
    assert eng.stats().num_used_blocks == 1 and eng.stats().fragmentation == 0.25
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().fragmentation == 0.0
    assert_no_leaks(eng)
