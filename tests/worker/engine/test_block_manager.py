"""BlockManager: allocation, growth, freeing, and a property test."""

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.block_manager import BlockManager


def test_allocate_grow_free():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate(1, 5)  # 2 blocks
    assert bm.num_used_blocks == 2 and bm.usage == 0.5
    assert bm.append_slots(1, num_computed_tokens=5) and len(bm.block_table(1)) == 2  # slot 6 fits
    assert bm.append_slots(1, num_computed_tokens=8) and len(bm.block_table(1)) == 3
    assert not bm.can_allocate(8) and bm.can_allocate(4)
    assert not bm.allocate(2, 8)  # no room: nothing changes
    assert not bm.has_blocks(2) and bm.num_free_blocks == 1
    assert bm.free(1) == 3 and bm.num_free_blocks == 4
    assert bm.free(99) == 0


def test_tables_are_disjoint():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate(1, 4)
    bm.allocate(2, 6)
    assert not set(bm.block_table(1)) & set(bm.block_table(2))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "append", "free"]), st.integers(0, 5), st.integers(1, 40)),
                max_size=60))
def test_random_operations_keep_invariants(ops):
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens: dict[int, int] = {}
    for op, seq, n in ops:
        if op == "free":
            bm.free(seq)
            tokens.pop(seq, None)
            continue
        want = n if op == "alloc" else tokens.get(seq, 0) + 1
        before = bm.num_free_blocks
        ok = bm.allocate(seq, want)
        if ok:
            tokens[seq] = max(tokens.get(seq, 0), want)
            assert len(bm.block_table(seq)) == bm.blocks_for(tokens[seq])
        else:
            assert bm.num_free_blocks == before
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        assert all(b.ref_count >= 0 for b in bm.blocks)
        held = [b for s in tokens for b in bm.block_table(s)]
        assert len(held) == len(set(held)) == bm.num_used_blocks
    for seq in list(tokens):
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
