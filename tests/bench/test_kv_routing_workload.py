"""bench/kv_routing.py's workloads: tenants share one system prompt each, the uniform
workload shares none, arrivals are Poisson (increasing, mean gap 1/rate)."""

from __future__ import annotations

from bench.kv_routing import workload
from tests.worker.fakes import fake_tokenizer


def test_tenants_share_their_system_prompts_and_uniform_requests_share_none():
    tok = fake_tokenizer()
    tenants = workload("tenants", tok, 60, 2.0, 8, 120, seed=1)
    uniform = workload("uniform", tok, 30, 2.0, 8, 120, seed=1)
    assert len({m[0]["content"] for _, m in tenants}) == 8
    assert len({m[0]["content"] for _, m in uniform}) == 30
    assert all(len(tok.encode(m[0]["content"])) >= 120 for _, m in tenants)
    times = [t for t, _ in tenants]
    assert times == sorted(times) and 0.25 < times[-1] / len(times) < 1.0  # mean gap 0.5 s
