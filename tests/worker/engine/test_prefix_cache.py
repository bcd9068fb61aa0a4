"""Prefix caching: chained block hashes, sharing with ref counts, LRU
eviction, and engine outputs identical cold vs warm (the fake runner reads
tokens back from KV slots, so wrong sharing changes the output)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.engine_helpers import assert_no_leaks, check_block_invariants, drain, make_engine, request
from worker.engine.block_manager import BlockManager
from worker.engine.engine import EngineRequest
from common.block_hash import block_hash
from worker.engine.sampling_params import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. Hello world, hello engine."


def _run_seq(bm, seq_id, tokens):
    hits = bm.cached_prefix(tokens, len(tokens) - 1)
    assert bm.allocate(seq_id, len(tokens), hits)
    bm.cache_full_blocks(seq_id, tokens, len(tokens))
    return hits


def test_hash_is_chained_and_salted():
    a = block_hash(None, [1, 2])
    assert block_hash(a, [3, 4]) != block_hash(block_hash(None, [9, 9]), [3, 4])
    assert block_hash(None, [1, 2], salt="m1") != block_hash(None, [1, 2], salt="m2")


def test_second_prompt_shares_full_blocks_and_keeps_last_token():
    bm = BlockManager(8, block_size=4, enable_prefix_caching=True)
    tokens = list(range(12))  # 3 full blocks
    assert _run_seq(bm, 1, tokens) == []
    hits = _run_seq(bm, 2, tokens)
    assert hits == bm.block_table(1)[:2]  # the last block holds the last token: computed again
    assert [bm.blocks[b].ref_count for b in hits] == [2, 2]
    check_block_invariants(bm)
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 3
    check_block_invariants(bm)


def test_diverging_prefix_hits_only_common_blocks():
    bm = BlockManager(8, block_size=4, enable_prefix_caching=True)
    _run_seq(bm, 1, list(range(12)))
    assert len(bm.cached_prefix([0, 1, 2, 3, 9, 9, 9, 9, 8, 8, 8, 8], 11)) == 1
    assert bm.cached_prefix([5, 1, 2, 3, 4, 5, 6, 7, 8], 8) == []


def test_lru_evicts_least_recently_freed_and_tail_first():
    bm = BlockManager(6, block_size=2, enable_prefix_caching=True)
    _run_seq(bm, 1, [1, 2, 3, 4])  # blocks 0, 1
    _run_seq(bm, 2, [5, 6, 7, 8])  # blocks 2, 3
    bm.free(1)
    bm.free(2)
    assert bm.cache.lru_order() == [1, 0, 3, 2]  # seq 1 freed first; each tail before its head
    assert bm.allocate(3, 6)  # 2 empty blocks first, then the LRU cached block 1
    assert bm.block_table(3) == [4, 5, 1] and bm.cache.lru_order() == [0, 3, 2]
    assert bm.cached_prefix([1, 2, 3, 4, 0], 4) == [0]  # block 1 (tokens 3, 4) was evicted
    hits = bm.cached_prefix([5, 6, 7, 8, 0], 4)
    assert hits == [2, 3] and bm.allocate(4, 5, hits)  # hits leave the LRU; the new block evicts 0
    assert bm.block_table(4) == [2, 3, 0] and bm.cache.lru_order() == []
    check_block_invariants(bm)


def test_no_room_with_prefix_changes_nothing():
    bm = BlockManager(3, block_size=2, enable_prefix_caching=True)
    _run_seq(bm, 1, [1, 2, 3, 4])
    bm.free(1)
    hits = bm.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8], 7)
    assert hits == [0, 1]  # freed tail-first: block 1 then block 0 in the LRU
    assert not bm.allocate(2, 10, hits)  # needs 3 more; only 1 empty (parked hits don't count)
    assert bm.cache.lru_order() == [1, 0] and not bm.has_blocks(2)
    check_block_invariants(bm)


def test_engine_warm_equals_cold_and_reports_hits():
    cold = make_engine(enable_prefix_caching=False)
    warm = make_engine()
    n = len(request("a", PROMPT).prompt_token_ids)
    for eng in (cold, warm):
        for rid in ("a", "b"):
            assert eng.add_request(request(rid, PROMPT, max_tokens=9)).ok
            drain(eng)  # b starts after a finished: its prompt blocks are cached
    outs_cold = {}
    for eng in (cold, warm):
        eng.add_request(request("c", PROMPT, max_tokens=9))
        results = {}
        while eng.has_unfinished():
            for out in eng.step():
                results.setdefault(out.request_id, []).append(out)
        outs_cold.setdefault("runs", []).append(results["c"])
    cold_c, warm_c = outs_cold["runs"]
    assert [t for o in cold_c for t in o.token_ids] == [t for o in warm_c for t in o.token_ids]
    assert cold_c[-1].cached_prompt_tokens == 0
    assert warm_c[-1].cached_prompt_tokens == (n - 1) // 4 * 4
    stats = warm.stats()
    assert stats.prefix_cache_queries == 3 * n and stats.prefix_cache_hits == 2 * ((n - 1) // 4 * 4)
    assert stats.num_cached_blocks > 0 and stats.num_free_blocks == stats.num_total_blocks
    assert_no_leaks(cold)
    assert_no_leaks(warm)


def test_generated_tokens_are_cached_too():
    eng = make_engine()
    eng.add_request(request("a", PROMPT, max_tokens=12))
    first = drain(eng)["a"].token_ids
    ids = request("x", PROMPT).prompt_token_ids + first  # a follow-up turn: prompt + answer
    eng.add_request(EngineRequest("b", ids, SamplingParams(temperature=0.0, max_tokens=3)))
    out = drain(eng)
    assert out["b"].token_ids and out["b"].finish_reason == "length"
    # every full block of the answer but the one still being decoded was hashed and hit
    assert eng.stats().prefix_cache_hits >= (len(ids) - 1) // 4 * 4 - 4
    assert_no_leaks(eng)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 10), st.integers(0, 4)), min_size=2, max_size=8),
       st.integers(8, 16))
def test_shared_prefixes_under_preemption_match_a_big_cold_cache(work, num_blocks):
    """Many requests sharing system prompts, a pool so small that preemption
    happens: same greedy tokens as a big cache without prefix caching."""
    systems = ["hello world hello engine", "paged attention batching", "fox dog fox"]
    big = make_engine(num_blocks=256, enable_prefix_caching=False)
    small = make_engine(num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=8)
    results = {}
    for eng in (big, small):
        got, step = {}, 0
        pending = sorted(enumerate(work), key=lambda w: w[1][2])
        while pending or eng.has_unfinished():
            while pending and pending[0][1][2] <= step:
                i, (sys_i, max_tokens, _) = pending.pop(0)
                r = request(f"r{i}", f"{systems[sys_i]} q{i}", max_tokens=max_tokens)
                if eng.scheduler.never_fits(len(r.prompt_token_ids), max_tokens) is None:
                    assert eng.add_request(r).ok
            for out in eng.step():
                got.setdefault(out.request_id, []).extend(out.token_ids)
            check_block_invariants(eng.block_manager)
            step += 1
            assert step < 3000
        results[eng is big] = got
        assert_no_leaks(eng)
    small_ids = set(results[False])
    assert {k: v for k, v in results[True].items() if k in small_ids} == results[False]
