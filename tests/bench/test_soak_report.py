"""The soak harness's accounting: every request ends completed, cancelled, failed with a
clear error (by code) or lost, and the report and files say so."""

from __future__ import annotations

import json

from bench.soak_report import SoakRecord, classify, error_code, summarize, table, write
from stack.clients import StreamResult

BODY_503 = json.dumps({"error": {"message": "request queue unavailable", "type": "service_unavailable_error",
                                 "code": "unavailable"}})


def _record(i: int, max_tokens: int = 32) -> SoakRecord:
    return SoakRecord(f"s{i}", "rest", float(i), max_tokens, None)


def _result(**kw) -> StreamResult:
    return StreamResult("rest", "p", **kw)


def test_error_codes_of_each_transport():
    assert error_code("HTTP 503: " + BODY_503) == "http 503 unavailable"
    assert error_code("HTTP 502: <html>bad gateway</html>") == "http 502"
    assert error_code("stream error aborted: the worker aborted the request") == "stream aborted"
    assert error_code("UNAVAILABLE: the worker disconnected") == "grpc UNAVAILABLE"


def test_each_outcome():
    done = classify(_record(0), _result(finish_reason="length", completion_tokens=32))
    failed = classify(_record(1), _result(error="HTTP 503: " + BODY_503))
    silent = classify(_record(2), _result(text="partial"))  # no finish_reason, no error
    hung = classify(_record(3), None, "hung past its deadline")
    broken = classify(_record(4), None, "transport RemoteProtocolError: peer closed connection")
    cancelled = classify(_record(5), None, "cancelled")
    assert [r.outcome for r in (done, failed, silent, hung, broken, cancelled)] == [
        "completed", "failed", "lost", "lost", "lost", "cancelled"]
    assert failed.code == "http 503 unavailable"
    assert silent.code == "ended without finish_reason or error" and hung.code == "hung past its deadline"


def test_summary_table_and_files(tmp_path):
    records = [classify(_record(0), _result(finish_reason="length", completion_tokens=32)),
               classify(_record(1), _result(finish_reason="length", completion_tokens=30)),
               classify(_record(2), _result(error="UNAVAILABLE: retry")),
               classify(_record(3), _result(error="UNAVAILABLE: retry")),
               classify(_record(4), None, "cancelled"),
               classify(_record(5), _result())]
    summary = summarize(records, settings={"rate": 0.3}, context={"machine": "cpu", "cores": 2, "commit": "abc"},
                        restart={"signal": "TERM", "at_s": 30.0, "exit_s": 2.0, "ready_s": 20.0, "exit_code": 0},
                        rss_mib={"worker": {"start": 900.0, "end": 950.0}, "gateway": {"start": 200.0, "end": 210.0}})
    assert summary.counts == {"sent": 6, "completed": 2, "cancelled": 1, "failed": 2, "lost": 1}
    assert summary.failed_by_code == {"grpc UNAVAILABLE": 2} and summary.token_mismatches == 1
    text = table(summary)
    assert "| 6 | 2 | 1 | 2 | 1 | 1 |" in text and "| grpc UNAVAILABLE | 2 |" in text
    assert "| worker | 900 | – | – | 950 |" in text and "worker restart (TERM)" in text
    csv_path, json_path = write(summary, records, tmp_path, "soak")
    assert len(csv_path.read_text().splitlines()) == 7
    assert json.loads(json_path.read_text())["counts"]["lost"] == 1
