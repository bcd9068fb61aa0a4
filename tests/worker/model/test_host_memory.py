"""worker.model.host_memory: MemAvailable and the room under a cgroup v2 memory limit."""

from worker.model.host_memory import available_bytes


def _files(tmp_path, meminfo="MemTotal: 100 kB\nMemAvailable:    2048 kB\n", limit=None, current="0"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "meminfo").write_text(meminfo)
    (tmp_path / "cgroup").write_text("0::/pod/worker\n")
    group = tmp_path / "fs" / "pod" / "worker"
    group.mkdir(parents=True)
    if limit is not None:
        (group / "memory.max").write_text(f"{limit}\n")
        (group / "memory.current").write_text(f"{current}\n")
    return tmp_path / "meminfo", tmp_path / "fs", tmp_path / "cgroup"


def test_mem_available_in_bytes_without_a_limit(tmp_path):
    assert available_bytes(*_files(tmp_path)) == 2048 * 1024
    assert available_bytes(*_files(tmp_path / "a", limit="max")) == 2048 * 1024  # "max": no limit


def test_the_room_under_a_smaller_cgroup_limit_wins(tmp_path):
    assert available_bytes(*_files(tmp_path, limit=1_500_000, current=1_000_000)) == 500_000
    assert available_bytes(*_files(tmp_path / "a", limit=10**12, current=0)) == 2048 * 1024  # larger: MemAvailable
    assert available_bytes(*_files(tmp_path / "b", limit=100, current=200)) == 0  # over the limit already


def test_unreadable_or_malformed_files_count_as_absent(tmp_path):
    assert available_bytes(tmp_path / "none", tmp_path / "none", tmp_path / "none") is None
    assert available_bytes(*_files(tmp_path, meminfo="MemAvailable: lots\n")) is None
    assert available_bytes(*_files(tmp_path / "a", meminfo="MemFree: 1 kB\n", limit=4096, current=96)) == 4000


def test_this_machine_reports_something_positive():
    got = available_bytes()
    assert got is None or got > 0
