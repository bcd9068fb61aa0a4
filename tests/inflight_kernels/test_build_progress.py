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


def test_a_build_past_its_timeout_is_killed_with_its_compilers_and_leaves_no_lock(tmp_path, monkeypatch):
    """A timed-out build child is killed with its own children (ninja's compilers), and the lock it
    took is removed: a lock left behind made every later build wait on it forever."""
    import os
    import subprocess

    import pytest

    monkeypatch.setattr(build, "SOURCES", ())
    monkeypatch.setattr(build, "SMOKE_TIMEOUT_S", 1.0)
    pid_file = tmp_path / "grandchild.pid"
    child = ("import pathlib, subprocess, sys, time; d = pathlib.Path(sys.argv[1]); (d / 'lock').touch(); "
             "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
             "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
             "(d / 'grandchild.pid').write_text(str(g.pid)); time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired):
        build._run_with_progress([sys.executable, "-c", child, str(tmp_path)], {}, tmp_path)
    assert not (tmp_path / "lock").exists()
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; the zombie is reaped by init
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{grandchild}/stat").read().split()[2] == "Z":
            break
        import time
        time.sleep(0.05)
    else:
        raise AssertionError("the build's own child outlived the timeout")


def test_another_builds_older_lock_is_kept_on_timeout(tmp_path, monkeypatch):
    import subprocess

    import pytest

    monkeypatch.setattr(build, "SOURCES", ())
    monkeypatch.setattr(build, "SMOKE_TIMEOUT_S", 0.5)
    (tmp_path / "lock").touch()
    import os
    os.utime(tmp_path / "lock", (1, 1))  # taken long before this build started
    with pytest.raises(subprocess.TimeoutExpired):
        build._run_with_progress([sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path)
    assert (tmp_path / "lock").exists()
