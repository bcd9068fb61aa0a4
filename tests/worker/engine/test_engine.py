"""LLMEngine end to end over the fake runner and a byte-level BPE."""

import pytest

from tests.worker.engine_helpers import assert_no_leaks, collect, drain, make_engine, request
from tests.worker.fakes import FakeRunner, fake_tokenizer
from worker.engine.engine_config import EngineConfig
from worker.engine.engine import AddStatus, Admission, EngineRequest, LLMEngine
from worker.engine.sampling_params import SamplingParams

PROMPTS = ["hello world", "你好，世界", "The quick brown fox", "🚀 launch", "continuous batching",
           "日本語", "paged attention", "lazy dog"]


def test_greedy_text_equals_one_shot_decode():
    eng = make_engine()
    for i, p in enumerate(PROMPTS):
        assert eng.add_request(request(f"r{i}", p, max_tokens=12)).ok
    results = drain(eng)
    tok = fake_tokenizer()
    for r in results.values():
        assert r.finish_reason == "length" and len(r.token_ids) == 12
        assert r.text == tok.decode(r.token_ids)
    assert_no_leaks(eng)


def test_max_tokens_one_gives_one_token():
    eng = make_engine()
    eng.add_request(request("a", max_tokens=1))
    results = drain(eng)
    assert results["a"].token_ids.__len__() == 1 and results["a"].finish_reason == "length"
    assert results["a"].num_outputs == 1
    assert_no_leaks(eng)


def test_continuous_short_request_joins_and_finishes_first():
    eng = make_engine()
    eng.add_request(request("long", max_tokens=40))
    results = {}
    for step in range(3):
        collect(eng.step(), results, step)
    eng.add_request(request("short", "hi", max_tokens=3))
    short_id = eng._groups["short"][0].seq_id
    long_id = eng._groups["long"][0].seq_id
    drain(eng, results, step0=3)
    assert results["short"].finished_step < results["long"].finished_step
    together = [mi for mi in eng.runner.inputs if {c.seq_id for c in mi.chunks} == {short_id, long_id}]
    assert together, "the short request never shared a step with the long one"
    assert_no_leaks(eng)


def test_preemption_under_tiny_cache_keeps_greedy_tokens():
    reqs = [request(f"r{i}", p, max_tokens=24) for i, p in enumerate(PROMPTS)]
    big = make_engine(num_blocks=128)
    small = make_engine(num_blocks=10)  # 40 slots; each request needs up to ~31
    for r in reqs:
        assert big.add_request(r).ok and small.add_request(r).ok
    want, got = drain(big), drain(small)
    assert small.stats().num_preemptions > 0
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    assert {k: v.text for k, v in got.items()} == {k: v.text for k, v in want.items()}
    assert_no_leaks(big)
    assert_no_leaks(small)


def test_chunked_prefill_matches_unchunked():
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    whole, chunked = make_engine(), make_engine(max_num_batched_tokens=7)
    for eng in (whole, chunked):
        eng.add_request(request("a", prompt, max_tokens=6))
        eng.add_request(request("b", "hello", max_tokens=6))
    a, b = drain(whole), drain(chunked)
    assert {k: v.token_ids for k, v in a.items()} == {k: v.token_ids for k, v in b.items()}
    assert max(mi.num_tokens for mi in chunked.runner.inputs) <= 7
    assert_no_leaks(chunked)


def _steps_to_first_token(engine, rid: str) -> int:
    for step in range(1, 200):
        if any(o.request_id == rid and o.token_ids for o in engine.step()):
            return step
    raise AssertionError(f"{rid} produced no token")


@pytest.mark.parametrize("threshold", [0, 8])
def test_long_prefill_threshold_lets_a_short_prompt_overtake_a_long_prefill(threshold):
    """A short prompt arrives while a long one is being prefilled in chunks. Without a
    threshold the long prompt takes the whole budget every step and the short one
    waits for all of it; with ``long_prefill_token_threshold`` the long prompt takes at
    most that many tokens a step, and the short one is admitted beside it at once."""
    eng = make_engine(num_blocks=128, max_num_batched_tokens=32, long_prefill_token_threshold=threshold)
    eng.add_request(request("long", "The quick brown fox jumps over the lazy dog. " * 24, max_tokens=2))
    eng.step()
    eng.add_request(request("short", "hello", max_tokens=2))
    long_prompt = len(eng._groups["long"][0].prompt_token_ids)
    steps = _steps_to_first_token(eng, "short")
    if threshold:
        assert steps == 1 and max(len(c.token_ids) for mi in eng.runner.inputs for c in mi.prefills) <= threshold
        assert eng._groups["long"][0].num_computed_tokens < long_prompt  # overtaken mid-prefill
    else:  # it waits until the long prompt's last chunk leaves room in a step
        assert steps >= (long_prompt - 32) // 32 >= 6
    drain(eng)
    assert_no_leaks(eng)


def test_abort_frees_blocks_immediately():
    eng = make_engine()
    eng.add_request(request("a", max_tokens=50))
    eng.add_request(request("b", max_tokens=50))
    eng.step()
    eng.step()
    used = eng.block_manager.num_used_blocks
    assert eng.abort("a") and not eng.abort("nope")
    assert eng.block_manager.num_used_blocks < used
    out = eng.step()
    assert [o.finish_reason for o in out if o.request_id == "a"] == ["abort"]
    eng.abort("b")
    assert eng.block_manager.num_used_blocks == 0
    assert [o.finish_reason for o in eng.step()] == ["abort"]
    assert_no_leaks(eng)


def test_seeded_tokens_same_alone_and_batched():
    def seeded(i):
        return request(f"s{i}", PROMPTS[i], max_tokens=10, temperature=1.0, top_p=0.9, seed=100 + i)

    alone = {}
    for i in (0, 3):
        eng = make_engine()
        eng.add_request(seeded(i))
        alone.update(drain(eng))
        assert_no_leaks(eng)
    eng = make_engine()
    for i in range(8):  # 0, 3 and 5 seeded; others unseeded random or greedy
        r = seeded(i) if i in (0, 3, 5) else request(f"u{i}", PROMPTS[i], max_tokens=10 + i,
                                                     temperature=1.3 if i % 2 else 0.0)
        eng.add_request(r)
    batched = drain(eng)
    for k in ("s0", "s3"):
        assert batched[k].token_ids == alone[k].token_ids
    assert_no_leaks(eng)


def test_stop_string_streamed_equals_non_streamed():
    base = make_engine()
    base.add_request(request("a", "你好", max_tokens=30))
    full = drain(base)["a"].text
    stop = full[10:13]
    first = full.find(stop)
    eng = make_engine()
    eng.add_request(request("a", "你好", max_tokens=30, stop=[stop, "never-seen"]))
    got = drain(eng)["a"]
    assert got.finish_reason == "stop" and got.text == full[:first]
    assert_no_leaks(eng)


def test_stop_token_ids_and_eos_finish_with_stop():
    base = make_engine()
    base.add_request(request("a", max_tokens=8))
    tokens = drain(base)["a"].token_ids
    eng = make_engine()
    eng.add_request(request("a", max_tokens=8, stop_token_ids=[tokens[3]]))
    got = drain(eng)["a"]
    assert got.finish_reason == "stop" and got.token_ids == tokens[: tokens.index(tokens[3]) + 1]
    tok = fake_tokenizer()
    results = {}
    for ignore in (False, True):
        eng = LLMEngine(FakeRunner(block_size=4, special_ids=tok.special_token_ids, eos_at=10), tok,
                        EngineConfig(block_size=4))
        eng.add_request(request("e", "hello world", max_tokens=20, ignore_eos=ignore))  # 5 prompt tokens
        results[ignore] = drain(eng)["e"]
        assert_no_leaks(eng)
    assert results[False].finish_reason == "stop" and len(results[False].token_ids) == 6
    assert results[False].token_ids[-1] in tok.eos_token_ids
    assert results[True].finish_reason == "length" and len(results[True].token_ids) == 20


def test_rejections_are_values():
    eng = make_engine(num_blocks=4)  # 16 slots
    assert eng.add_request(request("big", max_tokens=100)).status is AddStatus.NEVER_FITS
    assert eng.add_request(EngineRequest("e", [], SamplingParams())).status is AddStatus.INVALID
    bad = eng.add_request(request("t", temperature=-1))
    assert bad.status is AddStatus.INVALID and "temperature" in bad.reason
    assert eng.add_request(request("ok", max_tokens=2)).ok
    assert eng.add_request(request("ok", max_tokens=2)).status is AddStatus.DUPLICATE
    runner = FakeRunner(num_blocks=100, block_size=4, context_length=20)
    ctx = LLMEngine(runner, fake_tokenizer(), EngineConfig(block_size=4))
    assert ctx.add_request(request("c", max_tokens=19)).status is AddStatus.NEVER_FITS
    drain(eng)
    assert_no_leaks(eng)


def test_runner_failure_finishes_with_error():
    tok = fake_tokenizer()
    eng = LLMEngine(FakeRunner(block_size=4, fail=True), tok, EngineConfig(block_size=4))
    eng.add_request(request("a"))
    results = drain(eng)
    assert results["a"].finish_reason == "error"
    assert_no_leaks(eng)


def test_admission_and_stats():
    eng = make_engine(num_blocks=8, max_num_seqs=2)
    assert eng.admission(10, 5).verdict is Admission.START
    assert eng.admission(40, 5).verdict is Admission.NEVER and "KV blocks" in eng.admission(40, 5).reason
    eng.add_request(request("a", max_tokens=20))
    eng.add_request(request("b", max_tokens=20))
    assert eng.admission(1, 1).verdict is Admission.WAIT  # no batch slot
    assert eng.add_request(request("c", max_tokens=2), only_if_room=True).status is AddStatus.NO_ROOM
    assert eng.add_request(request("d", max_tokens=40), only_if_room=True).status is AddStatus.NEVER_FITS
    results = {}
    collect(eng.step(), results, 0)
    s = eng.stats()
    assert (s.num_running, s.num_waiting, s.last_batch_size) == (2, 0, 2)
    assert 0 < s.kv_usage <= 1 and s.num_free_blocks + eng.block_manager.num_used_blocks == 8
    drain(eng, results, step0=1)
    assert_no_leaks(eng)


@pytest.mark.parametrize("logprobs", [0, 2, 20])  # 20: the most a request may ask
def test_logprobs_returned_per_token(logprobs):
    eng = make_engine()
    eng.add_request(request("a", max_tokens=3, logprobs=logprobs, return_logprobs=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert all(len(o.logprobs) == 1 and len(o.logprobs[0].top) == logprobs for o in outs if o.token_ids)
    assert_no_leaks(eng)


def test_public_views_of_the_step_and_the_unfinished_requests():
    """``last_schedule`` (what the last step fed the model) and ``unfinished_request_ids``
    (what is left to abort): the engine's public surface the benches read."""
    eng = make_engine()
    assert eng.last_schedule is None and eng.unfinished_request_ids() == []
    for rid in ("a", "b"):
        assert eng.add_request(request(rid, "hello world", max_tokens=50)).ok
    assert eng.unfinished_request_ids() == ["a", "b"]
    eng.step()
    chunks = eng.last_schedule.model_input.chunks
    assert len(chunks) == 2 and sum(len(c.token_ids) for c in chunks) == 2 * len(request("x").prompt_token_ids)
    for rid in eng.unfinished_request_ids():
        eng.abort(rid)
    assert eng.unfinished_request_ids() == []
    assert {o.finish_reason for o in eng.step()} == {"abort"}
    assert eng.last_schedule.is_empty
    assert_no_leaks(eng)
