"""`inflight up` supervises its services: a worker or gateway that exits on its own is
started again (not in a tight loop), and a failed start leaves no process behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stack.stack import Stack, StackSettings


def _exited() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    return proc


def _sleeping() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_supervise_restarts_exited_services_at_most_once_per_interval(tmp_path, monkeypatch):
    stack = Stack(StackSettings(run_dir=tmp_path, redis_url="redis://127.0.0.1:1/0"))
    spawned: list[tuple[str, list[str]]] = []

    def fake_spawn(name, args):
        spawned.append((name, args))
        stack._procs[name] = _exited()  # the new one crashes too

    monkeypatch.setattr(stack, "_spawn", fake_spawn)
    alive = _sleeping()
    stack._procs.update(worker=_exited(), gateway=alive)
    try:
        assert stack.supervise(min_interval_s=60) == ["worker"]
        assert spawned[0][0] == "worker" and spawned[0][1][0] == "worker"
        assert "--redis-url" in spawned[0][1]
        assert "exited with 3; restarted" in (tmp_path / "worker.log").read_text()
        assert stack.supervise(min_interval_s=60) == []  # crash loop: not again at once
        assert stack.supervise(min_interval_s=0) == ["worker"]
    finally:
        alive.kill()
        alive.wait()


def test_a_failed_start_stops_what_it_started(tmp_path, monkeypatch):
    stack = Stack(StackSettings(run_dir=tmp_path, redis_url="redis://127.0.0.1:1/0", use_nginx=False))
    started: list[subprocess.Popen] = []

    def fake_spawn(name, args):
        stack._procs[name] = proc = _sleeping()
        started.append(proc)

    def not_ready():
        raise RuntimeError("gateway exited with 3")

    monkeypatch.setattr(stack, "_spawn", fake_spawn)
    monkeypatch.setattr(stack, "_check_ports_free", lambda: None)  # default ports: a stack may run here
    monkeypatch.setattr(stack, "_wait_url", lambda *args, **kwargs: None)  # the worker came up
    monkeypatch.setattr(stack, "_wait_ready", not_ready)
    with pytest.raises(RuntimeError, match="exited with 3"):
        stack.start()
    assert len(started) == 2 and all(p.poll() is not None for p in started)


def test_log_tail_keeps_the_first_lines_of_a_long_log(tmp_path):
    stack = Stack(StackSettings(run_dir=tmp_path))
    lines = ["OSError: address already in use"] + [f"line {i}" for i in range(100)]
    (tmp_path / "gateway.log").write_text("\n".join(lines))
    tail = stack.log_tail("gateway", lines=10)
    assert tail.startswith("OSError: address already in use") and tail.endswith("line 99")


def test_stop_removes_the_embedded_redis_directory_after_redis_died(tmp_path):
    """The embedded Redis was killed: stopping the stack still removes its socket
    directory (a new-user trial found /tmp/tmp*/redis.socket left behind)."""
    import os
    import signal

    stack = Stack(StackSettings(run_dir=tmp_path))
    stack._redis = stack._start_embedded_redis()
    redis_dir = stack._redis.redis_dir
    os.kill(stack._redis.pid, signal.SIGKILL)
    stack.stop()
    assert not os.path.exists(redis_dir) and stack._redis is None and stack.redis_url is None


def test_a_stack_over_ports_in_use_refuses_to_start_in_one_line(tmp_path):
    """A second stack on the ports of a running one: before, its readiness checks were
    answered by the first, it printed "ready" and a key nothing reads, and its services
    crash-looped on bind; now start() names the ports in use and starts nothing."""
    import socket

    from stack.stack import port_free
    from tests.helpers.redis_server import free_port

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        assert not port_free(port)
        free = [free_port() for _ in range(6)]
        settings = StackSettings(run_dir=tmp_path / "run", redis_url="redis://127.0.0.1:1/0", rest_port=port,
                                 grpc_port=free[0], link_port=free[1], worker_health_port=free[2],
                                 worker_grpc_health_port=free[3], edge_rest_port=free[4], edge_grpc_port=free[5])
        stack = Stack(settings)
        with pytest.raises(RuntimeError, match=rf"in use on 127.0.0.1: {port} \(gateway REST\).*--port-offset"):
            stack.start()
        assert not stack._procs and not (tmp_path / "run").exists()  # nothing was started
    finally:
        taken.close()
    assert port_free(port)
