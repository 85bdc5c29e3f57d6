"""available_memory_bytes: MemAvailable capped by the cgroup's headroom (containers see the host's meminfo)."""

from __future__ import annotations

from pathlib import Path

from pdserve.server.available_memory import available_memory_bytes, cgroup_headroom, meminfo_available


def test_meminfo_available_parses_kb(tmp_path: Path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2000000 kB\n")
    assert meminfo_available(str(f)) == 2000000 * 1024
    f.write_text("MemTotal: 1 kB\n")
    assert meminfo_available(str(f)) is None
    assert meminfo_available(str(tmp_path / "absent")) is None


def test_cgroup_headroom_v2_v1_and_unlimited(tmp_path: Path):
    lim, use = tmp_path / "max", tmp_path / "current"
    use.write_text("1073741824\n")
    lim.write_text("4294967296\n")
    assert cgroup_headroom(((str(lim), str(use)),)) == 3 << 30
    lim.write_text("max\n")
    assert cgroup_headroom(((str(lim), str(use)),)) is None
    lim.write_text(str(0x7FFFFFFFFFFFF000))  # v1's "no limit"
    assert cgroup_headroom(((str(lim), str(use)),)) is None
    lim.write_text("536870912\n")  # over the limit already: nothing left, never negative
    assert cgroup_headroom(((str(lim), str(use)),)) == 0
    assert cgroup_headroom(((str(tmp_path / "no"), str(use)), (str(lim), str(use)))) == 0  # first missing: next


def test_this_host_reports_something_sane():
    got = available_memory_bytes()
    assert got is not None and 0 < got <= 1 << 50
