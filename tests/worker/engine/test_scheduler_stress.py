"""Random workloads over a tiny KV cache: the scheduler never deadlocks, every
request finishes with the same greedy tokens as over a big cache, the token
budget and batch limits hold, and nothing leaks."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.engine_helpers import assert_no_leaks, collect, make_engine, request

WORDS = ["hello", "world", "你好", "🚀", "fox", "batch", "paged", "日本"]

workload = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 14), st.integers(0, 6)),
                    min_size=1, max_size=10)


def _run(eng, reqs, budget_check=None):
    results, pending, step = {}, list(reqs), 0
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            _, req = pending.pop(0)
            assert eng.add_request(req).ok
        collect(eng.step(), results, step)
        if budget_check:
            budget_check(eng)
        step += 1
        assert step < 3000, "no progress"
    return results


@settings(max_examples=15, deadline=None)
@given(workload, st.integers(6, 12), st.integers(3, 16))
def test_random_workload_tiny_cache(work, num_blocks, budget):
    reqs = []
    for i, (nwords, max_tokens, arrive) in enumerate(sorted(work, key=lambda w: w[2])):
        prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(nwords))
        reqs.append((arrive, request(f"r{i}", prompt, max_tokens=max_tokens)))
    big = make_engine(num_blocks=256)
    small = make_engine(num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=4)
    accepted = [(t, r) for t, r in reqs
                if small.scheduler.never_fits(len(r.prompt_token_ids), r.sampling_params.max_tokens) is None]

    def check(eng):
        last = eng.runner.inputs[-1] if eng.runner.inputs else None
        assert last is None or (last.num_tokens <= budget and len(last.chunks) <= 4)

    want = _run(big, accepted)
    got = _run(small, accepted, check)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    assert all(v.finish_reason == "length" for v in got.values())
    assert_no_leaks(big)
    assert_no_leaks(small)
