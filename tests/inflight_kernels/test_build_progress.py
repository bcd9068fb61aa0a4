"""inflight_kernels/cpu/build.py: the build child's progress, counted by the object files ninja writes."""

from __future__ import annotations

import logging
import sys

from common.progress import LOGGER_NAME
from inflight_kernels.cpu import build


def test_sources_compiled_so_far_are_reported_while_the_child_runs(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    monkeypatch.setattr(build, "SOURCES", (tmp_path / "a.cpp", tmp_path / "b.cpp"))
    for source in build.SOURCES:
        source.write_text("")
    child = ("import pathlib, time, sys; d = pathlib.Path(sys.argv[1]); time.sleep(0.3); (d / 'a.o').touch(); "
             "time.sleep(0.3); (d / 'b.o').touch(); print('ok')")
    import common.progress

    monkeypatch.setattr(common.progress.Progress, "__init__",
                        _with_interval(common.progress.Progress.__init__, 0.1))
    result = build._run_with_progress([sys.executable, "-c", child, str(tmp_path)], {}, tmp_path)
    assert result.returncode == 0 and result.stdout == "ok\n"
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "building the CPU kernels …"
    assert any("50% (1/2 sources)" in line for line in lines), lines
    assert lines[-1].startswith("building the CPU kernels: done in ") and lines[-1].endswith("(2 sources)")


def _with_interval(init, interval_s):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.interval_s = interval_s
    return patched
