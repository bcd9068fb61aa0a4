"""KV events: the prefix cache's stored/removed block hashes, replayed into a set,
always equal what the cache holds (what the worker publishes for KV-aware routing),
and the gateway's prompt hashes (common/block_hash.py) find the worker's blocks."""

from __future__ import annotations

from common.block_hash import prompt_block_hashes
from tests.worker.engine_helpers import drain, make_engine, request
from worker.engine.prefix_cache import KVEvents

PROMPTS = ["The quick brown fox jumps over the lazy dog. Hello world, hello engine.",
           "continuous batching keeps the accelerator busy; static batching waits.",
           "Hello world, hello engine, hello batching and paged attention."]


def test_events_replayed_into_a_set_equal_the_cache_through_evictions():
    engine = make_engine(num_blocks=12, block_size=4, enable_kv_events=True)
    mirror: set[int] = set()
    for i in range(12):  # 12 blocks: later prompts evict earlier ones' cached blocks
        engine.add_request(request(f"r{i}", PROMPTS[i % 3] * (1 + i % 2), max_tokens=3))
        drain(engine)
        add, drop = engine.take_kv_events().net()
        mirror = (mirror | add) - drop
        assert mirror == set(engine.cached_block_hashes())
    assert engine.block_manager.cache.num_parked > 0


def test_the_gateway_hashes_of_a_prompt_are_the_worker_blocks():
    engine = make_engine(num_blocks=64, block_size=4, enable_kv_events=True)
    req = request("a", PROMPTS[0], max_tokens=2)
    engine.add_request(req)
    drain(engine)
    held = set(engine.cached_block_hashes())
    hashes = prompt_block_hashes(req.prompt_token_ids, 4, engine.block_hash_salt)
    assert hashes and set(hashes) <= held
    assert not set(prompt_block_hashes(req.prompt_token_ids, 4, "another model")) & held


def test_no_events_are_kept_unless_asked():
    engine = make_engine(num_blocks=64, block_size=4)
    engine.add_request(request("a", PROMPTS[0], max_tokens=2))
    drain(engine)
    assert engine.cached_block_hashes() and not len(engine.take_kv_events())


def test_net_lets_the_last_event_of_a_hash_win():
    events = KVEvents()
    for stored, h in ((True, 1), (False, 1), (True, 2), (False, 3), (True, 3)):
        events.record(stored, h)
    assert events.net() == ({2, 3}, {1})
