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
    monkeypatch.setattr(build, "SMOKE_TIMEOUT_S", 3.0)
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


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (gone, or a zombie waiting to be reaped)."""
    import os

    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


def test_the_build_child_and_its_compilers_die_with_a_killed_parent(tmp_path):
    """A parent killed by SIGKILL runs no cleanup: the build child (its own session) notices
    through :func:`build.exit_with_parent` and kills its process group, compilers included
    (the new-user trial found compilers orphaned after a killed ``inflight up``)."""
    import signal
    import subprocess
    import time

    child = ("import inflight_kernels.cpu.build as b, os, subprocess, sys, time; b.exit_with_parent(os.getppid(), 0.05); "
             "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             "print(os.getpid(), g.pid, flush=True); time.sleep(60)")
    parent = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], start_new_session=True, "
              "stdout=sys.stdout); p.wait()")
    proc = subprocess.Popen([sys.executable, "-c", parent, child], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and not any(_gone(p) for p in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for _ in range(200):  # generous: the child polls every 0.05 s
        if all(_gone(p) for p in pids):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the build child or its compiler outlived the killed parent")


def test_compilers_in_their_own_process_groups_die_with_a_killed_parent():
    """ninja starts each compiler in a process group of its own (POSIX_SPAWN_SETPGROUP), in the
    build child's session: a killed parent's build child kills its whole session, so these
    compilers do not run on as orphans (they did when only the child's process group was
    killed: a new user's stopped ``inflight up`` left cc1plus running)."""
    import os
    import signal
    import subprocess
    import time

    child = ("import inflight_kernels.cpu.build as b, os, subprocess, sys, time; b.exit_with_parent(os.getppid(), 0.05); "
             "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], preexec_fn=os.setpgrp); "
             "print(os.getpid(), g.pid, flush=True); time.sleep(60)")
    parent = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], start_new_session=True, "
              "stdout=sys.stdout); p.wait()")
    proc = subprocess.Popen([sys.executable, "-c", parent, child], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and not any(_gone(p) for p in pids)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for _ in range(200):  # generous: the child polls every 0.05 s
            if all(_gone(p) for p in pids):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("a compiler in its own process group outlived the killed parent")
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_timed_out_build_kills_compilers_in_their_own_process_groups(tmp_path, monkeypatch):
    """The build's timeout kills the compilers that ninja put in process groups of their own,
    and returns at once (they held its pipes open: the timeout waited for them to finish)."""
    import os
    import subprocess

    import pytest

    monkeypatch.setattr(build, "SOURCES", ())
    monkeypatch.setattr(build, "SMOKE_TIMEOUT_S", 3.0)
    pid_file = tmp_path / "grandchild.pid"
    script = ("import os, subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
              f"preexec_fn=os.setpgrp); open({str(pid_file)!r}, 'w').write(str(g.pid)); time.sleep(60)")
    import time
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        build._run_with_progress([sys.executable, "-c", script], {}, tmp_path)
    # a surviving compiler held the child's pipes, so the build waited for it (60 s here)
    assert time.monotonic() - started < 30
    grandchild = int(pid_file.read_text())
    try:
        for _ in range(100):
            if _gone(grandchild):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("a compiler in its own process group outlived the timed-out build")
    finally:
        try:
            os.kill(grandchild, 9)
        except ProcessLookupError:
            pass
