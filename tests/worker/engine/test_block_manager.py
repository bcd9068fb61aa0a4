"""BlockManager: allocation, growth, freeing, fork and copy-on-write, and a property test."""

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


def test_fork_shares_and_the_first_writer_copies():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate(1, 6)  # blocks [a, b]; b holds tokens 4..5
    a, b = bm.block_table(1)
    assert bm.fork(1, 2, 6) and bm.block_table(2) == [a, b]
    assert bm.blocks[a].ref_count == bm.blocks[b].ref_count == 2 and bm.take_copies() == []
    assert bm.allocate(2, 7, write_from=5)  # the child writes token 5 (into b): it copies b
    (src, dst), = bm.take_copies()
    assert (src, bm.block_table(2)) == (b, [a, dst]) and bm.blocks[b].ref_count == 1
    assert bm.allocate(1, 7, write_from=6)  # b is the parent's alone now: written in place
    assert bm.take_copies() == [] and bm.block_table(1) == [a, b]
    assert bm.allocate(2, 9, write_from=8)  # a new block for token 8; block 0 stays shared
    assert bm.take_copies() == [] and bm.blocks[a].ref_count == 2
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 6 and all(x.ref_count == 0 for x in bm.blocks)


def test_copy_on_write_without_a_free_block_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.allocate(1, 6) and bm.fork(1, 2, 6)
    assert not bm.allocate(2, 6, write_from=5)
    assert bm.block_table(2) == bm.block_table(1) and bm.take_copies() == []
    assert not bm.fork(1, 2, 6) and not bm.fork(1, 3, 9)  # the child has a table; beyond the parent's


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
