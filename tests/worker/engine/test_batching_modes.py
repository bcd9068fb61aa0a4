"""Static and dynamic (request-level) batching versus continuous."""

from tests.worker.engine_helpers import assert_no_leaks, collect, drain, make_engine, request
from tests.worker.fakes import ManualClock


def _seq_ids_per_step(eng):
    return [{c.seq_id for c in mi.chunks} for mi in eng.runner.inputs]


def test_static_waits_for_a_full_batch_and_admits_no_joins():
    clock = ManualClock()
    eng = make_engine(clock=clock, batching="static", max_batch_size=2)
    eng.add_request(request("a", max_tokens=10))
    clock.advance(60.0)
    assert eng.step() == [] and not eng.runner.inputs  # one request never starts a static batch
    eng.add_request(request("b", max_tokens=4))
    results = {}
    collect(eng.step(), results, 0)
    first = {eng._groups[r][0].seq_id for r in ("a", "b")}
    assert _seq_ids_per_step(eng) == [first]
    eng.add_request(request("c", max_tokens=3))
    eng.add_request(request("d", max_tokens=3))
    c_id = eng._groups["c"][0].seq_id
    drain(eng, results, step0=1)
    steps = _seq_ids_per_step(eng)
    first_batch_steps = [i for i, ids in enumerate(steps) if ids & first]
    assert all(c_id not in steps[i] for i in first_batch_steps)  # no join while a/b run
    assert max(first_batch_steps) < min(i for i, ids in enumerate(steps) if c_id in ids)
    assert all(r.finish_reason == "length" for r in results.values())
    assert_no_leaks(eng)


def test_static_reserves_worst_case_blocks():
    eng = make_engine(num_blocks=64, block_size=4, batching="static", max_batch_size=2)
    eng.add_request(request("a", "hello world", max_tokens=11))  # 5 + 11 = 16 tokens = 4 blocks
    eng.add_request(request("b", "hello world", max_tokens=3))  # 8 tokens = 2 blocks
    eng.step()
    assert eng.block_manager.num_used_blocks == 6
    drain(eng)
    assert eng.stats().num_preemptions == 0
    assert_no_leaks(eng)


def test_dynamic_lone_request_starts_after_max_wait():
    clock = ManualClock()
    eng = make_engine(clock=clock, batching="dynamic", max_batch_size=4, max_wait_ms=5)
    eng.add_request(request("a", max_tokens=3))
    clock.advance(0.004)
    assert eng.step() == [] and not eng.runner.inputs
    assert abs(eng.next_batch_at() - (clock.now + 0.001)) < 1e-9
    clock.advance(0.002)
    eng.step()
    assert len(eng.runner.inputs) == 1
    drain(eng)
    assert_no_leaks(eng)


def test_dynamic_full_batch_starts_at_once_and_runs_to_completion():
    clock = ManualClock()
    eng = make_engine(clock=clock, batching="dynamic", max_batch_size=4, max_wait_ms=5)
    for i in range(5):
        eng.add_request(request(f"r{i}", max_tokens=3 + i))
    results = {}
    collect(eng.step(), results, 0)  # no time passed: the batch is full
    assert len(eng.runner.inputs[0].chunks) == 4
    late = eng._groups["r4"][0].seq_id
    drain(eng, results, step0=1, tick=0.001)
    steps = _seq_ids_per_step(eng)
    assert all(ids == {late} for ids in steps if late in ids)  # r4 ran alone, after the batch
    assert_no_leaks(eng)


def test_continuous_admits_every_step():
    eng = make_engine(max_num_seqs=64)
    for i in range(3):
        eng.add_request(request(f"r{i}", max_tokens=5))
    eng.step()
    assert len(eng.runner.inputs[0].chunks) == 3
    drain(eng)
    assert_no_leaks(eng)
