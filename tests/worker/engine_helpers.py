"""Small factories for engine tests: build an engine over the fakes, drive it
to completion, and check that nothing leaked."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.worker.fakes import FakeRunner, ManualClock, fake_tokenizer
from worker.engine.engine_config import EngineConfig
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.sampling_params import SamplingParams


@dataclass
class Result:
    """Everything streamed for one request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    finished_step: int = -1
    num_outputs: int = 0
    completion_tokens: int = 0


def make_engine(num_blocks: int = 64, block_size: int = 4, clock: ManualClock | None = None,
                **config) -> LLMEngine:
    tok = fake_tokenizer()
    runner = FakeRunner(num_blocks=num_blocks, block_size=block_size, special_ids=tok.special_token_ids)
    return LLMEngine(runner, tok, EngineConfig(block_size=block_size, **config), clock=clock or ManualClock())


def request(rid: str, prompt: str = "hello world", **params) -> EngineRequest:
    params.setdefault("temperature", 0.0)
    return EngineRequest(rid, fake_tokenizer().encode(prompt), SamplingParams(**params))


def drain(engine: LLMEngine, results: dict[str, Result] | None = None, max_steps: int = 2000,
          step0: int = 0, tick: float = 0.0) -> dict[str, Result]:
    """Step until nothing is unfinished, moving the engine's ManualClock by
    ``tick`` seconds per step; returns per-request results."""
    results = {} if results is None else results
    for step in range(step0, step0 + max_steps):
        if not engine.has_unfinished():
            return results
        collect(engine.step(), results, step)
        if tick:
            engine.clock.advance(tick)
    raise AssertionError("engine did not finish")


def collect(outputs, results: dict[str, Result], step: int) -> None:
    for out in outputs:
        r = results.setdefault(out.request_id, Result())
        assert out.text_delta or out.token_ids or out.finished, "empty output"
        assert r.finish_reason is None, "output after finish"
        r.text += out.text_delta
        r.token_ids += out.token_ids
        if r.num_outputs:  # counts grow by exactly the tokens streamed
            assert out.completion_tokens == r.completion_tokens + len(out.token_ids)
        r.num_outputs += 1
        r.completion_tokens = out.completion_tokens
        if out.finished:
            r.finish_reason, r.finished_step = out.finish_reason, step


def assert_no_leaks(engine: LLMEngine) -> None:
    """All blocks free, all ref counts zero, no sequences anywhere."""
    bm = engine.block_manager
    check_block_invariants(bm)
    assert bm.num_free_blocks == bm.num_blocks  # free or cached
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine._groups and not engine._detok and not len(engine._forks) and not engine.has_unfinished()


def check_block_invariants(bm) -> None:
    """Block-manager invariants: free + used = total; every ref count equals
    the number of tables holding the block (never negative); a block held by
    two sequences is a cached prefix block; free blocks have ref count 0."""
    holders: dict[int, int] = {}
    for table in bm._tables.values():
        assert len(set(table)) == len(table), "block twice in one table"
        for b in table:
            holders[b] = holders.get(b, 0) + 1
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert bm.num_used_blocks == len(holders)
    for block in bm.blocks:
        assert block.ref_count >= 0
        assert block.ref_count == holders.get(block.block_id, 0)
        if block.ref_count > 1:
            assert bm.cache.is_cached(block.block_id), "shared block without a prefix hash"
    free = list(bm._free) + bm.cache.lru_order()
    assert len(free) == len(set(free)) == bm.num_free_blocks
    assert all(bm.blocks[b].ref_count == 0 for b in free)
