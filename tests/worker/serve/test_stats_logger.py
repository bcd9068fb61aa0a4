"""worker/serve/stats_logger.py: vLLM's log_stats line every 10 s, and the last minute's throughput."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from worker.serve.stats_logger import StatsLogger, ThroughputWindow


def _stats(prompt: int, gen: int, running: int = 0, waiting: int = 0, kv: float = 0.0, queries: int = 0,
           hits: int = 0):
    return SimpleNamespace(prompt_tokens_total=prompt, generation_tokens_total=gen, num_running=running,
                           num_waiting=waiting, kv_usage=kv, prefix_cache_queries=queries, prefix_cache_hits=hits)


def test_one_line_per_interval_with_throughput_running_waiting_and_kv(caplog):
    caplog.set_level(logging.DEBUG, logger="inflight.stats")
    s = StatsLogger(interval_s=10)
    s.observe(_stats(0, 0), now=100.0)
    s.observe(_stats(500, 200, running=3, waiting=2, kv=0.25, queries=500, hits=100), now=105.0)
    assert not s.tick(now=109.0)
    assert s.tick(now=110.0)
    assert caplog.records[-1].levelno == logging.INFO
    assert caplog.records[-1].getMessage() == (
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 20.0%")
    assert not s.tick(now=115.0)


def test_idle_goes_to_debug_after_one_idle_line_and_the_flag_silences_it(caplog):
    caplog.set_level(logging.DEBUG, logger="inflight.stats")
    s = StatsLogger(interval_s=10)
    s.observe(_stats(0, 0), now=0.0)
    assert s.tick(now=10.0) and s.tick(now=20.0)
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.DEBUG]
    quiet = StatsLogger(interval_s=10, enabled=False)
    quiet.observe(_stats(0, 0), now=0.0)
    quiet.observe(_stats(0, 100, running=1), now=5.0)
    assert quiet.tick(now=10.0) and "Running: 1 reqs" in quiet.line
    assert len(caplog.records) == 2  # nothing more logged


def test_window_rates_cover_the_last_minute_only():
    w = ThroughputWindow(window_s=60)
    for t in range(0, 121):  # 10 generated tokens/s for the first minute, 2/s after
        w.add(float(t), prompt_total=t, generation_total=10 * min(t, 60) + 2 * max(0, t - 60))
    prompt, gen = w.rates(120.0)
    assert abs(prompt - 1.0) < 1e-9 and abs(gen - 2.0) < 0.05
    young = ThroughputWindow()
    young.add(0.0, 0, 0)
    young.add(10.0, 50, 100)
    assert young.rates(10.0) == (5.0, 10.0)  # a worker younger than the window: over its life


def test_disable_log_stats_reaches_the_worker_settings():
    from common.worker_options import WorkerOptions
    from worker.serve.options import to_settings

    assert to_settings(WorkerOptions()).log_stats is True
    assert to_settings(WorkerOptions(disable_log_stats=True)).log_stats is False
