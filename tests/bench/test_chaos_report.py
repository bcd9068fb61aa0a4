"""The chaos soak's bookkeeping (bench/chaos_faults.py, chaos_load.py, chaos_report.py): the
seeded schedule, the token check against the reference, error classification, the time to
recover from the probes, and the report's windows and files. The soak itself starts a whole
fleet (two real workers) and runs for minutes, so it is a benchmark (`inflight bench chaos`),
not a test."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from bench.chaos_faults import KINDS, parse_kinds, schedule
from bench.chaos_load import ChaosRecord, Endpoints, check_tokens, classify_exception
from bench.chaos_report import open_requests, recovery, summarize, table, token_rates, write


def test_the_schedule_is_seeded_scaled_and_covers_every_kind():
    short, again, other = schedule(300, seed=3), schedule(300, seed=3), schedule(300, seed=4)
    assert short == again and [f.kind for f in short] != [f.kind for f in other]
    assert sorted(f.kind for f in short) == sorted(KINDS)
    assert all(f.window_start_s <= f.at_s < f.window_end_s for f in short)
    assert short[0].window_start_s == 30 and short[-1].window_end_s == 300
    stop = next(f for f in short if f.kind == "worker-stop")
    assert stop.hold_s == pytest.approx(0.6 * (270 / 6))  # 30 s does not fit a 45 s window's 0.6
    long = schedule(1800, seed=3)
    assert len(long) == 2 * len(KINDS) and next(f for f in long if f.kind == "worker-stop").hold_s == 30
    with pytest.raises(ValueError):
        schedule(100, seed=0)


def test_the_schedule_does_only_the_chosen_faults():
    kills = schedule(300, seed=3, kinds=("worker-kill",))  # one window per 150 s per kind
    assert [f.kind for f in kills] == ["worker-kill", "worker-kill"]
    assert (kills[0].window_start_s, kills[0].window_end_s, kills[1].window_end_s) == (30, 165, 300)
    two = schedule(600, seed=3, kinds=parse_kinds("worker-kill, redis-kill"))
    assert sorted(f.kind for f in two) == ["redis-kill", "redis-kill", "worker-kill", "worker-kill"]
    assert parse_kinds("all") == KINDS
    with pytest.raises(ValueError):
        parse_kinds("worker-kill,meteor")
    with pytest.raises(ValueError):
        schedule(300, seed=3, kinds=())


class _Chars:
    """A tokenizer with one token per character."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]


def _ends() -> Endpoints:
    return Endpoints("http://x", "x:1", "k", "m", ["p"], 8, references={("rest", 0): "abcdefgh"},
                     encode=_Chars.encode)


def test_token_check_counts_repeated_and_missing_tokens():
    same, twice, short = (ChaosRecord(f"c{i}", "stream", 0.0, 8, 0) for i in range(3))
    check_tokens(same, _ends(), "rest", "abcdefgh")
    check_tokens(twice, _ends(), "rest", "abcdcdefgh")  # "cd" delivered twice
    check_tokens(short, _ends(), "rest", "abcfgh")       # "de" never delivered
    assert same.checked and (same.extra_tokens, same.missing_tokens) == (0, 0)
    assert (twice.extra_tokens, twice.missing_tokens) == (2, 0)
    assert (short.extra_tokens, short.missing_tokens) == (0, 2)
    unchecked = ChaosRecord("c3", "grpc", 0.0, 8, 0)
    check_tokens(unchecked, _ends(), "grpc", "zzz")  # no gRPC reference: not checked
    assert not unchecked.checked


def test_errors_are_clear_or_lost():
    request = httpx.Request("POST", "http://x/v1/chat/completions")
    status = openai.APIStatusError("unavailable", response=httpx.Response(503, request=request),
                                   body={"error": {"code": "redis_unavailable", "message": "retry"}})
    event = openai.APIError("aborted", request, body={"code": "slow_consumer", "message": "cancelled"})
    rpc = grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details="deadline")
    records = [ChaosRecord(f"c{i}", "stream", 0.0, 8) for i in range(4)]
    for record, exc in zip(records, [status, event, rpc, httpx.RemoteProtocolError("peer closed")]):
        classify_exception(record, exc)
    assert [(r.outcome, r.code) for r in records] == [
        ("failed", "http 503 redis_unavailable"), ("failed", "stream error slow_consumer"),
        ("failed", "grpc DEADLINE_EXCEEDED"), ("lost", "transport RemoteProtocolError")]


def test_recovery_from_the_probes():
    faults = schedule(300, seed=1)
    for f in faults:
        f.injected_s = f.at_s
    first, second = faults[0], faults[1]
    probes = [(first.at_s + 0.5, True, 0.1, "200"), (first.at_s + 1.5, False, 0.2, "503"),
              (first.at_s + 2.5, True, 9.0, "200"),  # slow, but served
              (first.at_s + 3.5, False, 20.0, "ReadTimeout"), (first.at_s + 4.5, True, 0.4, "200"),
              (second.at_s + 1.0, True, 0.3, "200"), (second.window_end_s - 0.5, False, 0.1, "503"),
              (second.window_end_s + 1.0, True, 0.2, "200")]  # served again after its window
    recovery(faults, probes)
    assert first.served_after_s == pytest.approx(4.9) and first.worst_probe_s == 20.0
    assert second.served_after_s == pytest.approx(second.window_end_s + 1.2 - second.at_s)
    assert faults[2].served_after_s is None and faults[2].worst_probe_s is None  # no probe in its window
    recovery(faults, [(first.at_s + 1.0, True, 3.0, "200")])
    assert first.served_after_s == 0.0 and first.worst_probe_s == 3.0  # nothing failed


def test_windows_total_table_and_files(tmp_path):
    faults = schedule(300, seed=1)
    for f in faults:
        f.injected_s = f.at_s
    records = [ChaosRecord("c0", "stream", 5.0, 8, outcome="completed", checked=True),
               ChaosRecord("c1", "grpc", faults[0].at_s + 1, 8, outcome="completed", resumes=1, checked=True,
                           extra_tokens=2),
               ChaosRecord("c2", "complete", faults[0].at_s + 2, 8, outcome="failed", code="http 503 x"),
               ChaosRecord("c3", "stalled", faults[3].at_s, 4000, outcome="ended"),
               ChaosRecord("c4", "stream", 299.0, 8, outcome="lost", code="hung past its deadline")]
    records[0].end_s, records[1].end_s = faults[0].at_s + 7.5, faults[0].at_s + 3.0  # c0 open at the fault
    open_requests(faults, records)
    assert (faults[0].open_at_fault, faults[0].open_ended_after_s) == (1, 7.5)
    rss = {"worker": (11, 1000.0), "nginx": (12, 10.0)}
    summary = summarize(records, faults, rss_start=rss, rss_end={"worker": (13, 1100.0), "nginx": (12, 10.0)},
                        restarts=[(40.0, "gateway")], context={"command": "inflight bench chaos --duration 300"},
                        rss_warm={"worker": (11, 1050.0), "nginx": (14, 10.0)}, rss_warm_s=30.0)
    assert summary.windows[0]["window"] == "warm-up" and summary.windows[0]["sent"] == 1
    assert summary.windows[1]["sent"] == 2 and summary.windows[1]["resumed"] == 1
    assert summary.windows[-1]["lost"] == 1  # the last window runs to the end of the load
    assert sum(w["sent"] for w in summary.windows) == summary.total["sent"] == 5
    assert (summary.total["ended"], summary.total["extra_tokens"]) == (1, 2)
    assert [r["rid"] for r in summary.lost] == ["c1", "c4"]
    text = table(summary)
    assert f"| {faults[0].kind} | {faults[0].at_s:g} | 0 | – |" in text  # waited for quiet, queue at fault
    assert "| 1: 7.5 |" in text
    assert "| total | 5 | 2 | 0 | 1 | 1 | 1 | 2 | 1 | 2 | 0 |" in text and "gateway at 40 s" in text
    assert "| RSS after warm-up (at 30 s) (MiB) |" in text
    assert "| worker | 11 | 1000 | 1050 | 13 | 1100 | 1.05 (another process) |" in text
    assert "| nginx | 12 | 10 | 10 | 12 | 10 | 1.00 (another process) |" in text
    samples = [{"t": 0.0, "worker_tokens": 0.0, "worker-2_tokens": 10.0, "queue_depth": 0, "worker_running": 1},
               {"t": 1.0, "worker_tokens": 20.0, "worker-2_tokens": 0.0, "queue_depth": 2, "worker_running": 2}]
    assert token_rates(samples) == [(1.0, 20.0)]  # worker-2 restarted: its counter went down
    paths = write(summary, records, samples, [(1.0, False, 0.1, "503")], text, tmp_path, "run")
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    assert paths[0].read_text().splitlines()[-1].startswith("total,5,2,0,1,1,1")


def test_a_fault_waits_for_the_queue_and_the_fleet_after_the_one_before():
    import argparse

    from bench.chaos import Chaos

    before = schedule(300, seed=1)[:2]
    chaos = Chaos(argparse.Namespace(seed=0), fleet=None, ends=None, faults=before)
    before[0].kind, before[0].injected_s = "worker-kill", before[0].at_s
    chaos.samples = [{"t": 1.0, "queue_depth": 0}, {"t": 2.0, "queue_depth": 3}, {"t": 3.0, "queue_depth": 0}]
    assert not chaos._quiet([])  # a backlog in the last three samples
    chaos.samples.append({"t": 4.0, "queue_depth": 0})
    chaos.samples.append({"t": 5.0, "queue_depth": 0})
    assert chaos._quiet([]) and not chaos._quiet(before[:1])  # the killed worker is not back yet
    before[0].whole_after_s = 12.0
    assert chaos._quiet(before[:1])
