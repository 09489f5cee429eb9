"""Resource limits below the sandbox (engines.childproc.limits): where a host's cgroups are
made, and a child's own cgroups on this host — joined before it runs, emptied and removed when
it is closed. The bombs they stop are in test_sandbox_kernel_only.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines.childproc import limits
from engines.childproc.host import ChildProcess, Launch
from engines.childproc.limits import Hierarchy, Limits, find_hierarchies
from tests.conftest import need
from wm.config import Settings

#: The shape of /proc/self/mountinfo and /proc/self/cgroup on a hybrid (v1 + v2) host.
HYBRID_MOUNTS = """\
30 25 0:26 / {root}/unified rw,relatime shared:5 - cgroup2 cgroup2 rw
31 25 0:27 / {root}/memory rw,relatime shared:6 - cgroup cgroup rw,memory
32 25 0:28 / {root}/pids rw,relatime shared:7 - cgroup cgroup rw,pids
33 25 0:29 / {root}/cpu rw,relatime shared:8 - cgroup cgroup rw,cpu
"""
HYBRID_OWN = "8:pids:/\n4:memory:/jobs/a1\n1:cpu:/\n0::/\n"
UNIFIED_MOUNTS = "30 25 0:26 / {root} rw,relatime shared:5 - cgroup2 cgroup2 rw,nsdelegate\n"


def _cgroup(path: Path, controllers: str = "", enabled: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.controllers").write_text(controllers)
    (path / "cgroup.subtree_control").write_text(enabled)
    return path


def test_cgroup_v2_is_preferred_and_its_controllers_enabled(tmp_path: Path) -> None:
    own = _cgroup(tmp_path / "svc", "cpu memory pids")
    mounts = HYBRID_MOUNTS.format(root=tmp_path) + UNIFIED_MOUNTS.format(root=tmp_path)
    (tmp_path / "memory" / "jobs" / "a1").mkdir(parents=True)
    found = find_hierarchies(mounts, "4:memory:/jobs/a1\n0::/svc\n")
    assert found == (Hierarchy("memory", 2, str(own)), Hierarchy("pids", 2, str(own)))
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_a_v2_cgroup_without_the_controllers_delegates_through_its_parent(
    tmp_path: Path,
) -> None:
    """The node in a leaf of a delegated subtree: its parent hands out memory and pids."""
    parent = _cgroup(tmp_path / "delegated", "memory pids", "memory pids")
    _cgroup(parent / "node", "")
    found = find_hierarchies(UNIFIED_MOUNTS.format(root=tmp_path), "0::/delegated/node\n")
    assert {h.base for h in found} == {str(parent)} and {h.version for h in found} == {2}


def test_a_hybrid_host_uses_the_v1_hierarchies_below_its_own_cgroups(tmp_path: Path) -> None:
    """This machine's kind: the unified hierarchy has no memory or pids controller."""
    _cgroup(tmp_path / "unified", "hugetlb")
    (tmp_path / "memory" / "jobs" / "a1").mkdir(parents=True)
    (tmp_path / "pids").mkdir()
    found = find_hierarchies(HYBRID_MOUNTS.format(root=tmp_path), HYBRID_OWN)
    assert found == (
        Hierarchy("memory", 1, str(tmp_path / "memory" / "jobs" / "a1")),
        Hierarchy("pids", 1, str(tmp_path / "pids")),
    )


def test_without_a_writable_hierarchy_there_is_no_cgroup_layer(tmp_path: Path) -> None:
    """Cgroup directories missing (or not ours to write): the children keep their rlimits."""
    assert find_hierarchies(HYBRID_MOUNTS.format(root=tmp_path), HYBRID_OWN) == ()
    assert find_hierarchies("", "0::/\n") == ()


def test_the_empty_cgroups_of_a_killed_host_are_removed(tmp_path: Path) -> None:
    """A node killed with SIGKILL leaves its children's cgroups; the next probe clears them."""
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    (tmp_path / f"wm-{dead.pid}-1").mkdir()
    (tmp_path / f"wm-{os.getpid()}-1").mkdir()
    (tmp_path / "other").mkdir()
    limits._remove_orphans(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", f"wm-{os.getpid()}-1"]


def test_the_limits_come_from_the_node_settings_unless_overridden() -> None:
    defaults = Settings.from_env({})
    assert Limits.from_settings(defaults) == Limits(1024 << 20, 64)
    assert Limits.from_settings(defaults, memory_mb=200).memory_bytes == 200 << 20
    configured = Settings.from_env({"WM_SANDBOX_MEMORY_MB": "300", "WM_SANDBOX_MAX_PROCESSES": "9"})
    assert Limits.from_settings(configured) == Limits(300 << 20, 9)


#: Starts a grandchild that leaves the session (out of reach of killpg), then waits.
ESCAPING_CHILD = """
import os, time
if os.fork() == 0:
    os.setsid()
time.sleep(120)
"""


def test_a_helper_runs_in_cgroups_of_its_own_which_close_empties_and_removes() -> None:
    hierarchies = limits.placement()
    if {h.controller for h in hierarchies} != set(limits.CONTROLLERS):
        need("writable cgroup memory and pids hierarchies", RuntimeError(repr(hierarchies)))
    launch = Launch((sys.executable, "-c", ESCAPING_CHILD), {}, limits=Limits(256 << 20, 16))
    child = ChildProcess(launch, _NoSinks())
    escaped = _escaped(child.pid, hierarchies[0])
    cgroups = {_cgroup_of(child.pid, h) for h in hierarchies}
    assert cgroups == {_cgroup_of(escaped, h) for h in hierarchies}
    for hierarchy in hierarchies:
        directory = _cgroup_of(child.pid, hierarchy)
        assert os.path.basename(directory).startswith(f"wm-{os.getpid()}-")
        limit = "memory.limit_in_bytes" if hierarchy.version == 1 else "memory.max"
        name = limit if hierarchy.controller == "memory" else "pids.max"
        expected = 256 << 20 if hierarchy.controller == "memory" else 16
        assert int(Path(directory, name).read_text()) == expected
    child.close()
    assert not _alive(escaped)  # killpg cannot reach it; its cgroup did
    assert not any(os.path.exists(directory) for directory in cgroups)


class _NoSinks:
    def log(self, level: int, message: str) -> None:
        raise AssertionError("no log frames expected")

    def gateway(self, call: object, request: bytes, deadline: float) -> tuple[int, bytes]:
        raise AssertionError("no gateway frames expected")


def _escaped(pid: int, hierarchy: Hierarchy) -> int:
    """The child's child, once it left the child's session (the child joins its cgroups
    first thing, then forks)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        cgroup = _cgroup_of(pid, hierarchy)
        if os.path.basename(cgroup).startswith("wm-"):
            others = {int(p) for p in Path(cgroup, "cgroup.procs").read_text().split()} - {pid}
            if others and os.getsid(min(others)) != os.getsid(pid):
                return min(others)
        time.sleep(0.05)
    raise AssertionError("the child's child never left its session")


def _cgroup_of(pid: int, hierarchy: Hierarchy) -> str:
    """The directory of ``pid``'s cgroup in ``hierarchy``."""
    with open(f"/proc/{pid}/cgroup", encoding="ascii") as handle:
        for line in handle:
            _, names, path = line.rstrip("\n").split(":", 2)
            wanted = names == "" if hierarchy.version == 2 else hierarchy.controller in names
            if wanted:
                return os.path.join(hierarchy.base, os.path.basename(path))
    raise AssertionError(f"pid {pid} has no {hierarchy.layer} cgroup")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in {"Z", "X"}
    except FileNotFoundError:
        return False


@pytest.fixture(autouse=True)
def _no_cgroup_left_behind() -> object:
    yield
    leftovers = [
        os.path.join(h.base, name)
        for h in limits.placement()
        for name in os.listdir(h.base)
        if name.startswith(f"wm-{os.getpid()}-")
    ]
    assert not leftovers
