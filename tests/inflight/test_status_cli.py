"""`inflight status` as a command: --watch --json prints one fleet per line until stopped; a
Redis that does not answer is one line and exit status 1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from tests.helpers.redis_server import free_port, start_redis


def test_watch_json_prints_one_fleet_per_refresh():
    server = start_redis()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "inflight.cli", "status", "--json", "--watch", "0.2",
                                 "--redis-url", server.url], stdout=subprocess.PIPE, text=True)
        lines = [proc.stdout.readline() for _ in range(3)]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        server.stop()
    views = [json.loads(line) for line in lines]
    assert [v["workers"] for v in views] == [[], [], []] and views[0]["queue_depth"] == {"0": 0, "1": 0, "2": 0}
    assert views[0]["taken_unix_s"] < views[2]["taken_unix_s"]


def test_an_unreachable_redis_is_one_line():
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "inflight.cli", "status", "--redis-url",
                          f"redis://127.0.0.1:{free_port()}/0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.startswith("inflight status: Redis at redis://127.0.0.1:")
    assert len(out.stderr.strip().splitlines()) == 1 and time.monotonic() - started < 30


def test_watch_into_a_pipe_prints_each_refresh():
    """`inflight status --watch > log` printed nothing until Ctrl-C (rich's Live draws to a
    terminal only): piped, each refresh is printed as it is taken."""
    server = start_redis()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "inflight.cli", "status", "--watch", "0.2",
                                 "--redis-url", server.url], stdout=subprocess.PIPE, text=True)
        titles = []
        while len(titles) < 2:
            line = proc.stdout.readline()
            assert line, "the watch ended"
            if line.startswith("inflight fleet"):
                titles.append(line)
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
    finally:
        server.stop()
    assert len(titles) == 2


def test_watch_stops_on_sigint_even_when_started_with_sigint_ignored():
    """A background job of a non-interactive shell (`nohup inflight status --watch 5 > log &`)
    starts with SIGINT ignored; the watch still ends on it, as its help promises."""
    server = start_redis()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "inflight.cli", "status", "--json", "--watch", "0.2",
                                 "--redis-url", server.url], stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        assert proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        server.stop()
