"""Parallel sampling (n > 1): the prompt prefilled once and its KV blocks shared by
reference count, the shared last block copied on write; each choice its own seed; abort
and runner failure end the whole group."""

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
    assert prefill == prompt_len + 3  # each forked sibling recomputes only the prompt's last token
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


def test_without_prefix_caching_the_prompt_is_still_prefilled_once_and_shared():
    eng = make_engine(enable_prefix_caching=False)
    prompt_len = len(request("x", PROMPT).prompt_token_ids)
    eng.add_request(_group(n=3, max_tokens=4))
    first = [out for _ in range(2) for out in eng.step()]  # choice 0's prefill, then the siblings' last token
    group = eng._groups["g"]
    tables = [eng.block_manager.block_table(s.seq_id) for s in group]
    full = (prompt_len - 1) // 4  # blocks wholly before the prompt's last token: shared, never copied
    assert all(t[:full] == tables[0][:full] for t in tables)
    assert all(eng.block_manager.blocks[b].ref_count == 3 for b in tables[0][:full])
    outs = _run(eng)
    for out in reversed(first):
        outs[out.index].insert(0, out)
    assert all(len(_tokens(outs[i])) == 4 for i in range(3))
    prefill = sum(len(c.token_ids) for mi in eng.runner.inputs for c in mi.chunks if c.start_pos < prompt_len)
    assert prefill == prompt_len + 2
    assert_no_leaks(eng)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_copy_on_write_keeps_each_choice_on_its_own_tokens(prefix_caching):
    """The prompt's last block is shared when the choices start writing into it: each
    writer but the last copies it first. Seeded choices must draw exactly what they draw
    when each runs as its own request (the fake runner reads every slot back, so a choice
    writing into a block another still reads would change the other's tokens)."""
    params = dict(max_tokens=10, temperature=1.0, seed=77, ignore_eos=True)
    prompt_len = len(request("x", PROMPT).prompt_token_ids)
    assert prompt_len % 4, "the prompt must end inside a block for this test"
    eng = make_engine(num_blocks=64, block_size=4, enable_prefix_caching=prefix_caching)
    assert eng.add_request(_group(n=4, **params)).ok
    outs = _run(eng)
    copies = [pair for mi in eng.runner.inputs for pair in mi.blocks_to_copy]
    assert len(copies) == 3 and len({src for src, _ in copies}) == 1  # the last prompt block, 3 times
    for i in range(4):
        alone = make_engine(num_blocks=64, block_size=4, enable_prefix_caching=prefix_caching)
        one = request(f"c{i}", PROMPT, **params)
        seeded = choice_params(one.sampling_params, i)
        alone.add_request(EngineRequest(one.request_id, one.prompt_token_ids, seeded))
        assert _tokens(outs[i]) == _tokens(_run(alone)[0]), f"choice {i}"
    assert_no_leaks(eng)


def test_n_choices_hold_fewer_blocks_than_n_requests():
    """n = 8 on one prompt against 8 requests of that prompt, prefix caching off: the
    choices share the prompt's blocks (the PagedAttention paper's memory saving)."""
    def peak(requests) -> int:
        eng = make_engine(num_blocks=256, block_size=4, enable_prefix_caching=False)
        for r in requests:
            assert eng.add_request(r).ok
        most = 0
        while eng.has_unfinished():
            eng.step()
            most = max(most, eng.block_manager.num_used_blocks)
        return most

    params = dict(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    shared = peak([_group(n=8, **params)])
    separate = peak([request(f"r{i}", PROMPT, **params) for i in range(8)])
    prompt_blocks = -(-len(request("x", PROMPT).prompt_token_ids) // 4)
    assert shared <= prompt_blocks + 8 * 3  # the prompt once, then per choice its copy and its new blocks
    assert separate >= 8 * prompt_blocks


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
    """1,000 n = 3 requests through one engine, after 300 to warm up, leave no
    per-request state behind (vLLM #12973 leaked host memory per n > 1 request)."""
    import gc
    import tracemalloc

    eng = make_engine(num_blocks=64, block_size=4, enable_prefix_caching=True)

    def batch(start: int) -> None:
        for i in range(start, start + 100):
            assert eng.add_request(_group(n=3, rid=f"g{i}", max_tokens=2, temperature=1.0)).ok
            _run(eng)
        eng.runner.inputs.clear()  # the fake runner's own record of every step

    for start in range(0, 300, 100):  # warm: caches, interned strings, torch's small allocations (the
        batch(start)                    # traced total plateaus after about 300 requests, ~100 KB above the first)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for start in range(300, 1300, 100):
        batch(start)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    # the test alone grows ~100 KB; a full suite run once counted 366 KB (threads other tests left
    # running allocate too). 1 MiB over 1,000 requests still fails a leak of 1 KiB per request.
    assert grown < 1024 * 1024, grown
    assert not eng._groups and not eng._detok and not len(eng._forks)
    assert_no_leaks(eng)


def test_forked_choices_read_the_copied_kv_of_the_real_runner():
    """The real runner and KV cache: greedy choices forked onto the prompt's blocks,
    prefix caching off, answer exactly what n = 1 answers (the copied block's KV is
    the prompt's)."""
    import dataclasses

    from tests.worker.fakes import fake_tokenizer
    from worker.engine.engine import LLMEngine
    from worker.engine.engine_config import EngineConfig
    from worker.model.model_runner import tiny_random_runner

    def answers(n: int) -> dict[int, list]:
        runner = tiny_random_runner(seed=5, vocab_size=fake_tokenizer().vocab_size, block_size=16, num_blocks=32)
        config = dataclasses.replace(EngineConfig(block_size=16, enable_prefix_caching=False), num_blocks=32)
        eng = LLMEngine(runner, fake_tokenizer(), config)
        assert eng.add_request(_group(n=n, max_tokens=8, ignore_eos=True)).ok
        return {i: _tokens(o) for i, o in _run(eng).items()}

    one, three = answers(1), answers(3)
    assert three == {0: one[0], 1: one[0], 2: one[0]}
