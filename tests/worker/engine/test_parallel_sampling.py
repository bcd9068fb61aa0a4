"""Parallel sampling (n > 1): the prompt prefilled once and its full KV blocks shared by
reference count; each choice its own seed; abort and runner failure end the whole group."""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.worker.engine_helpers import assert_no_leaks, make_engine, request
from worker.engine.engine import EngineRequest
from worker.engine.parallel_sampling import choice_params
from worker.engine.sampling_params import SamplingParams

PROMPT = "the quick brown fox jumps over the lazy dog and then some more words"


def _group(prompt: str = PROMPT, n: int = 4, rid: str = "g", **params) -> EngineRequest:
    base = request(rid, prompt, **params)
    return EngineRequest(base.request_id, base.prompt_token_ids, base.sampling_params, n=n)


def _run(eng, max_steps: int = 500) -> dict[int, list]:
    """Drain the engine; per choice index, its outputs in order."""
    by_choice = defaultdict(list)
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            by_choice[out.index].append(out)
    assert not eng.has_unfinished()
    return by_choice


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_greedy_choices_agree_and_the_prompt_is_prefilled_once():
    eng = make_engine(num_blocks=64, block_size=4, enable_prefix_caching=True)
    prompt_len = len(request("x", PROMPT).prompt_token_ids)
    assert eng.add_request(_group(max_tokens=5)).ok
    outs = _run(eng)
    assert sorted(outs) == [0, 1, 2, 3]
    assert all(_tokens(outs[i]) == _tokens(outs[0]) for i in range(4))
    assert all(outs[i][-1].finished and outs[i][-1].finish_reason == "length" for i in range(4))
    prefill = sum(len(c.token_ids) for mi in eng.runner.inputs for c in mi.chunks if c.start_pos < prompt_len)
    tail = prompt_len - (prompt_len - 1) // 4 * 4  # each sibling recomputes the prompt past its cached full blocks
    assert prefill <= prompt_len + 3 * tail
    assert eng.stats().prompt_tokens_total == prompt_len  # counted once per request
    assert_no_leaks(eng)


def test_full_prompt_blocks_are_shared_by_reference_count():
    eng = make_engine(num_blocks=64, block_size=4, enable_prefix_caching=True)
    eng.add_request(_group(max_tokens=8))
    for _ in range(3):
        eng.step()
    group = eng._groups["g"]
    tables = [eng.block_manager.block_table(s.seq_id) for s in group if eng.block_manager.has_blocks(s.seq_id)]
    assert len(tables) == 4
    shared = tables[0][0]
    assert all(t[0] == shared for t in tables) and eng.block_manager.blocks[shared].ref_count == 4
    _run(eng)
    assert_no_leaks(eng)


def test_seeded_choices_differ_and_choice_zero_is_the_single_sample():
    params = dict(max_tokens=12, temperature=1.0, seed=1234)
    one = make_engine(enable_prefix_caching=True)
    one.add_request(request("s", PROMPT, **params))
    single = _tokens(_run(one)[0])
    many = make_engine(enable_prefix_caching=True)
    many.add_request(_group(n=3, rid="s", **params))
    outs = _run(many)
    assert _tokens(outs[0]) == single
    assert len({tuple(_tokens(outs[i])) for i in range(3)}) == 3
    assert choice_params(SamplingParams(seed=1234), 1).seed != choice_params(SamplingParams(seed=1234), 2).seed


def test_without_prefix_caching_every_choice_still_completes():
    eng = make_engine(enable_prefix_caching=False)
    eng.add_request(_group(n=3, max_tokens=4))
    outs = _run(eng)
    assert all(len(_tokens(outs[i])) == 4 for i in range(3))
    assert_no_leaks(eng)


def test_abort_ends_every_choice_including_held_ones():
    eng = make_engine(enable_prefix_caching=True)
    eng.add_request(_group(n=4, max_tokens=50))
    assert eng.abort("g")  # before the first step: choices 1..3 are still held
    outs = _run(eng)
    assert sorted(outs) == [0, 1, 2, 3] and all(o[-1].finish_reason == "abort" for o in outs.values())
    assert_no_leaks(eng)


def test_runner_failure_ends_held_choices_too():
    eng = make_engine(enable_prefix_caching=True)
    eng.runner.fail = True
    eng.add_request(_group(n=3, max_tokens=5))
    outs = _run(eng)
    assert sorted(outs) == [0, 1, 2] and all(o[-1].finish_reason == "error" for o in outs.values())
    assert_no_leaks(eng)


@pytest.mark.parametrize("bad", [0, -1])
def test_n_below_one_is_invalid(bad):
    eng = make_engine()
    assert not eng.add_request(_group(n=bad)).ok


def test_preempted_choices_resume_and_no_choice_is_lost():
    """A cache too small for the whole group: choices are preempted (recompute) and come
    back; every choice ends with all its tokens, seeded choices with the tokens they
    draw in a roomy cache, and nothing leaks."""
    params = dict(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    roomy = make_engine(num_blocks=128, block_size=4, enable_prefix_caching=True)
    assert roomy.add_request(_group(n=4, **params)).ok
    expected = {i: _tokens(outs) for i, outs in _run(roomy).items()}
    tight = make_engine(num_blocks=22, block_size=4, enable_prefix_caching=True)
    assert tight.add_request(_group(n=4, **params)).ok
    outs = _run(tight, max_steps=2000)
    assert tight.stats().num_preemptions > 0
    assert {i: _tokens(o) for i, o in outs.items()} == expected
    assert all(o[-1].finished and o[-1].finish_reason == "length" for o in outs.values())
    assert_no_leaks(tight)


def test_host_memory_is_flat_over_many_parallel_requests():
    """1,000 n = 3 requests through one engine leave no per-request state behind
    (vLLM #12973 leaked host memory per n > 1 request)."""
    import gc
    import tracemalloc

    eng = make_engine(num_blocks=64, block_size=4, enable_prefix_caching=True)

    def batch(start: int) -> None:
        for i in range(start, start + 100):
            assert eng.add_request(_group(n=3, rid=f"g{i}", max_tokens=2, temperature=1.0)).ok
            _run(eng)
        eng.runner.inputs.clear()  # the fake runner's own record of every step

    batch(0)  # warm: caches, interned strings
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for start in range(100, 1000, 100):
        batch(start)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 256 * 1024, grown
    assert not eng._groups and not eng._detok and not len(eng._forks)
    assert_no_leaks(eng)
