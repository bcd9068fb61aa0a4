"""stack/startup.py: the worker's progress lines relayed by `inflight up`, and each step timed."""

from __future__ import annotations

import io
import json
import logging

from common.logs import JsonFormatter
from common.progress import LOGGER_NAME
from stack.startup import LogFollower, StartupSteps, progress_message


def test_progress_lines_are_found_in_text_and_json_logs_and_nothing_else():
    record = logging.makeLogRecord({"name": LOGGER_NAME, "msg": "loading x.gguf: 41% (1.0 MB/2.4 MB), 4 s",
                                    "levelname": "INFO"})
    assert progress_message(JsonFormatter().format(record)) == "loading x.gguf: 41% (1.0 MB/2.4 MB), 4 s"
    assert progress_message(f"2026-01-01 00:00:00,000 INFO {LOGGER_NAME}: warm-up: 3 s") == "warm-up: 3 s"
    assert progress_message("2026-01-01 00:00:00,000 INFO worker.serve.main: ready") is None
    assert progress_message(json.dumps({"logger": "other", "msg": "x"})) is None
    assert progress_message("{not json") is None


def test_the_follower_reads_only_new_whole_lines(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text(f"x INFO {LOGGER_NAME}: old\n")
    follow = LogFollower(log)
    assert follow.new_progress() == []
    with open(log, "a") as f:
        f.write(f"x INFO {LOGGER_NAME}: one\nx INFO other: two\nx INFO {LOGGER_NAME}: hal")
    assert follow.new_progress() == ["one"]
    with open(log, "a") as f:
        f.write("f\n")
    assert follow.new_progress() == ["half"]


def test_steps_print_their_start_end_and_a_summary():
    out = io.StringIO()
    steps = StartupSteps(out)
    with steps.step("redis"):
        pass
    with steps.step("worker"):
        steps.say("loading x.gguf: done in 1.0 s")
    try:
        with steps.step("gateway"):
            raise RuntimeError("gone")
    except RuntimeError:
        pass
    text = out.getvalue().splitlines()
    assert text[0] == "[1] redis …" and text[2] == "[2] worker …" and text[3] == "    loading x.gguf: done in 1.0 s"
    assert text[-1].startswith("    gateway: failed after ")
    assert steps.summary().startswith("ready in ") and "redis 0.0 s, worker 0.0 s" in steps.summary()
