"""Scheduling policies with a scripted clock: fair (DRR) shares admissions
between a flooding and a light tenant, sjf aging bounds the wait of long
requests, priority orders admission and preemption, and a large request is
not starved by a stream of small ones."""

from dataclasses import replace

from tests.worker.engine_helpers import assert_no_leaks, make_engine, request
from tests.worker.fakes import ManualClock
from worker.engine.block_manager import BlockManager
from worker.engine.engine_config import EngineConfig
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus

LONG = "The quick brown fox jumps over the lazy dog. hello engine hello batching"


def _req(rid, prompt, max_tokens, tenant="", priority=1):
    return replace(request(rid, prompt, max_tokens=max_tokens, ignore_eos=True), tenant=tenant, priority=priority)


def _first_output_steps(eng, arrivals, max_steps=3000, until=None):
    """Add ``arrivals[step]`` before each step (clock +1 s per step); returns
    request id -> step of its first token. Stops when idle or at ``until``."""
    first, step = {}, 0
    while step < max_steps and (eng.has_unfinished() or any(s >= step for s in arrivals)):
        for r in arrivals.get(step, []):
            assert eng.add_request(r).ok
        for out in eng.step():
            first.setdefault(out.request_id, step)
        eng.clock.advance(1.0)
        step += 1
        if until is not None and step >= until:
            break
    return first


def test_fair_light_tenant_starts_within_bounded_steps():
    def run(policy):
        eng = make_engine(num_blocks=512, policy=policy, max_num_seqs=4, enable_prefix_caching=False)
        flood = [_req(f"a{i}", LONG, 8, tenant="A") for i in range(100)]
        light = [_req(f"b{i}", "hi", 2, tenant="B") for i in range(10)]
        first = _first_output_steps(eng, {0: flood, 1: light})
        assert_no_leaks(eng)
        return max(first[f"b{i}"] for i in range(10))

    fair, fcfs = run("fair"), run("fcfs")
    assert fair <= 30, fair  # B gets its share of every admission round
    assert fcfs > 150, fcfs  # behind all 100 of A's requests


def test_sjf_aging_bounds_the_wait_of_a_long_request():
    def run(rate):
        eng = make_engine(num_blocks=512, policy="sjf", max_num_seqs=1, sjf_aging_tokens_per_s=rate,
                          enable_prefix_caching=False)
        big = _req("big", LONG, 20)
        cost = len(big.prompt_token_ids) + 20
        small = {s: [_req(f"s{s}", "hi", 2)] for s in range(1, 200)}
        first = _first_output_steps(eng, {0: [big, _req("s0", "hi", 2)], **small}, until=200)
        return first.get("big"), cost

    started, cost = run(rate=5.0)
    # overtaken only by smalls arriving within cost / rate seconds (1 per step), each taking 2 steps
    assert started is not None and started <= 2 * (cost / 5.0 + 2), (started, cost)
    assert run(rate=0.0)[0] is None  # without aging the stream of short requests starves it


def test_priority_zero_is_admitted_first():
    eng = make_engine(num_blocks=512, max_num_seqs=1)
    first = _first_output_steps(eng, {0: [_req("low", "hello", 2, priority=2), _req("top", "world", 2, priority=0)]})
    assert first["top"] < first["low"]
    assert_no_leaks(eng)


def _seq(seq_id, n, priority, now):
    return Sequence(seq_id, f"r{seq_id}", list(range(1, n + 1)), SamplingParams(max_tokens=8),
                    arrival_time=now, priority=priority)


def test_preemption_picks_lowest_priority_before_most_recent():
    cfg = EngineConfig(block_size=4, enable_prefix_caching=False)
    sch = Scheduler(cfg, BlockManager(4, 4), max_model_len=64, clock=ManualClock())
    low, high = _seq(0, 7, priority=2, now=0.0), _seq(1, 7, priority=0, now=1.0)

    def step(*new):
        for seq in new:
            sch.add(seq)
        out = sch.schedule()
        sch.on_executed(out)
        for seq in out.scheduled:
            seq.output_token_ids.append(5)  # what the sampler would do
        return out

    step(low)  # low admitted first: 2 blocks
    step(high)  # high admitted most recently: 2 blocks, the pool is full
    out = step()  # both decode position 8 and need a third block
    assert out.preempted == [low] and out.scheduled == [high]
    assert low.status is SequenceStatus.PREEMPTED and sch.waiting == [low]


def test_large_request_is_not_starved_by_a_stream_of_small_ones():
    def run(starvation_s):
        eng = make_engine(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=64, starvation_s=starvation_s,
                          enable_prefix_caching=False)
        big = _req("big", f"{LONG} {LONG}", 4)  # 9 blocks; the stream keeps fewer free
        assert eng.scheduler.bm.blocks_for(len(big.prompt_token_ids) + 4) <= 16  # it can fit
        arrivals = {s: [_req(f"s{s}.{k}", "fox dog", 5) for k in range(2)] for s in range(60)}
        arrivals[10] = arrivals[10] + [big]
        return _first_output_steps(eng, arrivals, until=60).get("big")

    assert run(starvation_s=1e9) is None  # backfilling small requests forever
    started = run(starvation_s=3.0)
    assert started is not None and started <= 10 + 3 + 10, started  # threshold + drain of running smalls
