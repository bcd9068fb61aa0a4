"""worker.model.host_memory: MemAvailable and the room under cgroup v2 and v1 memory limits."""

from worker.model.host_memory import available_bytes

MEMINFO = "MemTotal: 100 kB\nMemAvailable:    2048 kB\n"


def _host(tmp_path, cgroup_line="0::/pod/worker", meminfo=MEMINFO):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "meminfo").write_text(meminfo)
    (tmp_path / "cgroup").write_text(f"1:cpu:/\n{cgroup_line}\n")
    (tmp_path / "fs").mkdir(exist_ok=True)
    return tmp_path / "meminfo", tmp_path / "fs", tmp_path / "cgroup"


def _limit(folder, limit, usage, names=("memory.max", "memory.current")):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / names[0]).write_text(f"{limit}\n")
    (folder / names[1]).write_text(f"{usage}\n")


def test_mem_available_in_bytes_without_a_limit(tmp_path):
    assert available_bytes(*_host(tmp_path)) == 2048 * 1024
    files = _host(tmp_path / "a")
    _limit(files[1] / "pod" / "worker", "max", 5)  # "max": no limit
    assert available_bytes(*files) == 2048 * 1024


def test_the_smallest_room_of_the_group_and_its_ancestors_wins(tmp_path):
    files = _host(tmp_path)
    _limit(files[1] / "pod" / "worker", 1_500_000, 1_000_000)
    assert available_bytes(*files) == 500_000
    _limit(files[1] / "pod", 1_200_000, 1_000_000)  # the pod's limit is tighter than the container's
    assert available_bytes(*files) == 200_000
    _limit(files[1] / "pod" / "worker", 100, 200)  # over its limit already
    assert available_bytes(*files) == 0


def test_a_larger_limit_leaves_mem_available(tmp_path):
    files = _host(tmp_path)
    _limit(files[1] / "pod" / "worker", 10**12, 0)
    assert available_bytes(*files) == 2048 * 1024


def test_inside_a_container_the_root_files_are_the_groups(tmp_path):
    files = _host(tmp_path, "0::/host/path/not/mounted/here")
    _limit(files[1], 1_000_000, 400_000)
    assert available_bytes(*files) == 600_000


def test_cgroup_v1_limits_count_and_its_no_limit_value_does_not(tmp_path):
    v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    files = _host(tmp_path, "4:memory,hugetlb:/docker/abc")
    _limit(files[1] / "memory" / "docker" / "abc", 1_000_000, 250_000, v1)
    assert available_bytes(*files) == 750_000
    files = _host(tmp_path / "a", "4:memory:/docker/abc")
    _limit(files[1] / "memory" / "docker" / "abc", 9223372036854771712, 250_000, v1)
    assert available_bytes(*files) == 2048 * 1024


def test_unreadable_or_malformed_files_count_as_absent(tmp_path):
    assert available_bytes(tmp_path / "none", tmp_path / "none", tmp_path / "none") is None
    assert available_bytes(*_host(tmp_path, meminfo="MemAvailable: lots\n")) is None
    files = _host(tmp_path / "a", "garbage line", meminfo="MemFree: 1 kB\n")
    assert available_bytes(*files) is None
    files = _host(tmp_path / "b", meminfo="MemFree: 1 kB\n")
    _limit(files[1] / "pod" / "worker", "lots", 1)
    _limit(files[1] / "pod", 4096, 96)
    assert available_bytes(*files) == 4000


def test_this_machine_reports_something_or_nothing():
    got = available_bytes()
    assert got is None or got >= 0
