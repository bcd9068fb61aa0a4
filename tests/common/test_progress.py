"""common/progress.py: a log line every few seconds off a terminal, a rich bar on one."""

from __future__ import annotations

import io
import logging
import time

from common.progress import LOGGER_NAME, Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_logs_the_start_lines_every_interval_and_the_end(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    with Progress("loading model.gguf", total=268_100_000, unit="B", interval_s=0.05, stream=io.StringIO()) as p:
        p.advance(110_200_000)
        time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert lines[0] == "loading model.gguf …"
    assert any(line.startswith("loading model.gguf: 41% (110.2 MB/268.1 MB), ") for line in lines[1:-1]), lines
    assert lines[-1].startswith("loading model.gguf: done in ") and lines[-1].endswith("(110.2 MB)")


def test_counts_and_unknown_totals_read_as_a_person_says_them(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    with Progress("building", total=10, unit="sources", stream=io.StringIO()) as p:
        p.update(7)
        assert p.line().startswith("building: 70% (7/10 sources), ")
    with Progress("warm-up", stream=io.StringIO()) as p:
        assert p.line() == "warm-up: 0 s"


def test_a_failure_is_logged_as_such(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    try:
        with Progress("warm-up", stream=io.StringIO()):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert caplog.records[-1].getMessage().startswith("warm-up: failed after ")


def test_on_a_terminal_a_bar_is_drawn_and_no_interval_lines(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    tty = _Tty()
    with Progress("loading model.gguf", total=1000, unit="B", interval_s=0.01, stream=tty) as p:
        p.update(500)
        time.sleep(0.1)
    assert "loading model.gguf" in tty.getvalue() and "━" in tty.getvalue()  # rich's bar
    assert [r.getMessage() for r in caplog.records][:-1] == []  # only the closing line is logged
