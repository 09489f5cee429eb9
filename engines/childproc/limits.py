"""Resource limits below the sandbox: each child in a cgroup of its own.

The sandbox's audit hook refuses process creation, and each child has rlimits on its own
address space and CPU time, but a child that got past the hook (native code with raw memory
access, an interpreter bug) could still fork without end, or spread memory over many
processes each within its rlimit; and RLIMIT_NPROC binds no process of host uid 0, not even
one in a user namespace (bwrap maps its uid to the host's). A cgroup bounds the child and
everything it starts together: ``memory`` their total memory (the kernel's OOM killer ends a
process inside when it is reached), ``pids`` their number of processes and threads.

Where the cgroups are made is found once per host process (:func:`placement`), best first:

* **cgroup v2** — the unified hierarchy with the ``memory`` and ``pids`` controllers, in the
  node's own cgroup when controllers can be enabled below it (the root cgroup, or an empty
  delegated one), else in its parent: a delegated subtree (systemd ``Delegate=yes``) whose
  leaf the node runs in.
* **cgroup v1** — per controller, a directory below the node's own cgroup in that
  controller's hierarchy (hybrid hosts mount ``memory`` and ``pids`` there).
* nothing: the child keeps only its rlimits; the node logs what is missing.

Empty cgroups left by a host process that was killed (its children's cgroups outlive it) are
removed by the next host process that probes the hierarchy.

A child joins its cgroups before anything of it runs: the host starts it through ``sh``,
which writes its own pid into each ``cgroup.procs`` and then execs the child's command (a
``preexec_fn`` is unsafe with threads, and Python cannot clone into a cgroup). When the child
is closed, whatever is left in its cgroups is killed — also processes that left its session
— and the cgroups are removed.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wm.config import Settings

logger = logging.getLogger(__name__)

#: Controllers a child's cgroup limits.
CONTROLLERS = ("memory", "pids")
#: Where cgroup file systems are mounted: ``/proc/self/mountinfo``.
MOUNTINFO = "/proc/self/mountinfo"
#: The node's own cgroups: ``/proc/self/cgroup``.
OWN_CGROUP = "/proc/self/cgroup"
#: Joins the cgroups named by its arguments up to ``--``, then execs the rest.
JOIN_SCRIPT = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
#: seconds to wait for a closed child's cgroup to empty (SIGKILL is asynchronous).
EMPTY_WAIT_S = 2.0
#: seconds between two looks at a cgroup being emptied.
EMPTY_POLL_S = 0.01
#: Name prefix of the cgroups made here (``wm-<host pid>-<n>``).
PREFIX = "wm-"
#: Limit files per (hierarchy version, controller); a ``?`` marks an optional one.
LIMIT_FILES = {
    (2, "memory"): ("memory.max", "?memory.swap.max"),
    (2, "pids"): ("pids.max",),
    (1, "memory"): ("memory.limit_in_bytes", "?memory.memsw.limit_in_bytes"),
    (1, "pids"): ("pids.max",),
}

_serial = itertools.count(1)


@dataclass(frozen=True)
class Limits:
    """What one child and everything it starts may use together; 0 means no limit."""

    memory_bytes: int
    max_processes: int

    @classmethod
    def from_settings(cls, settings: Settings, memory_mb: int | None = None) -> Limits:
        """The node's limits (``WM_SANDBOX_MEMORY_MB``, ``WM_SANDBOX_MAX_PROCESSES``);
        ``memory_mb`` overrides the memory limit (a worker's own, when it has one)."""
        memory = settings.sandbox_memory_mb if memory_mb is None else memory_mb
        return cls(memory << 20, settings.sandbox_max_processes)

    def value(self, controller: str) -> int:
        return self.memory_bytes if controller == "memory" else self.max_processes


@dataclass(frozen=True)
class Hierarchy:
    """Where children's cgroups of one controller are made: below ``base`` (a directory of
    a cgroup file system of ``version`` 1 or 2)."""

    controller: str
    version: int
    base: str

    @property
    def layer(self) -> str:
        return f"cgroup v{self.version} {self.controller}"


# -- finding the hierarchies -----------------------------------------------------------------


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(file system type, mount root, mount point, super options) of cgroup mounts."""
    found = []
    for line in mountinfo.splitlines():
        head, _, tail = line.partition(" - ")
        fields, described = head.split(), tail.split()
        if len(fields) >= 5 and len(described) >= 3 and described[0] in ("cgroup", "cgroup2"):
            options = set(described[2].split(","))
            found.append((described[0], fields[3], fields[4], options))
    return found


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """The node's cgroup path per controller; the unified hierarchy's under ``""``."""
    paths = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else [""]:
                paths[name] = parts[2]
    return paths


def _on_disk(mount_root: str, mount_point: str, path: str) -> str:
    relative = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path
    return os.path.normpath(os.path.join(mount_point, relative.lstrip("/")))


def _read(path: str) -> str:
    with open(path, encoding="ascii") as handle:
        return handle.read()


def _writable_below(base: str) -> bool:
    """Whether a cgroup can be made (and removed) below ``base``."""
    probe = os.path.join(base, f"{PREFIX}probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError:
        return False
    return True


def _v2_base(candidate: str) -> bool:
    """Whether children below ``candidate`` get memory and pids (enabled if need be)."""
    try:
        if not set(CONTROLLERS) <= set(_read(f"{candidate}/cgroup.controllers").split()):
            return False
        enabled = set(_read(f"{candidate}/cgroup.subtree_control").split())
        missing = [c for c in CONTROLLERS if c not in enabled]
        if missing:
            with open(f"{candidate}/cgroup.subtree_control", "w", encoding="ascii") as handle:
                handle.write(" ".join(f"+{c}" for c in missing))
    except OSError:  # no such file, or EBUSY: the cgroup holds processes (not the root)
        return False
    return _writable_below(candidate)


def _v2(mounts: list[tuple[str, str, str, set[str]]], own: Mapping[str, str]) -> list[Hierarchy]:
    if "" not in own:
        return []
    for kind, root, point, _ in mounts:
        if kind != "cgroup2":
            continue
        mine = _on_disk(root, point, own[""])
        for candidate in [mine] if mine == point else [mine, os.path.dirname(mine)]:
            if _v2_base(candidate):
                return [Hierarchy(c, 2, candidate) for c in CONTROLLERS]
    return []


def _v1(
    mounts: list[tuple[str, str, str, set[str]]], own: Mapping[str, str], controller: str
) -> Hierarchy | None:
    for kind, root, point, options in mounts:
        if kind == "cgroup" and controller in options and controller in own:
            base = _on_disk(root, point, own[controller])
            if _writable_below(base):
                return Hierarchy(controller, 1, base)
    return None


def find_hierarchies(mountinfo: str, proc_cgroup: str) -> tuple[Hierarchy, ...]:
    """The best hierarchy per controller this process can make cgroups in (see the module
    doc); a controller with none is left out."""
    mounts, own = _mounts(mountinfo), _own_paths(proc_cgroup)
    found = _v2(mounts, own)
    if found:
        return tuple(found)
    return tuple(h for h in (_v1(mounts, own, c) for c in CONTROLLERS) if h is not None)


@functools.cache
def placement() -> tuple[Hierarchy, ...]:
    """This host's hierarchies (probed once per process), logged with what is missing."""
    try:
        found = find_hierarchies(_read(MOUNTINFO), _read(OWN_CGROUP))
    except OSError as exc:
        logger.warning("child process limits: cannot read the cgroups of this process: %s", exc)
        found = ()
    logger.info("child process limit layers: %s", ", ".join(h.layer for h in found) or "no cgroup")
    for hierarchy in found:
        _remove_orphans(hierarchy.base)
    missing = [c for c in CONTROLLERS if c not in {h.controller for h in found}]
    if missing:
        logger.warning(
            "child processes run without a cgroup %s limit: no writable cgroup hierarchy with "
            "the controller (run the node as root, or in a delegated cgroup v2 subtree)",
            " or ".join(missing),
        )
    return found


def _remove_orphans(base: str) -> None:
    """Remove the empty cgroups left by host processes that died before closing their
    children (a node killed with SIGKILL); one still in use is never empty."""
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            owner = name[len(PREFIX) :].partition("-")[0]
            if name.startswith(PREFIX) and owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(base, name))


def layers() -> tuple[str, ...]:
    """Names of the limit layers children get here (``cgroup v1 memory`` …)."""
    return tuple(h.layer for h in placement())


# -- one child's cgroups ---------------------------------------------------------------------


def _write_limits(directory: str, hierarchy: Hierarchy, value: int) -> None:
    v1_memory = (hierarchy.version, hierarchy.controller) == (1, "memory")
    text = str(value) if value > 0 else "-1" if v1_memory else "max"
    for name in LIMIT_FILES[(hierarchy.version, hierarchy.controller)]:
        optional = name.startswith("?")
        path = os.path.join(directory, name.lstrip("?"))
        if optional and not os.path.exists(path):
            continue
        try:
            with open(path, "w", encoding="ascii") as handle:
                handle.write(text)
        except OSError:
            if not optional:
                raise


class Cgroups:
    """The cgroups of one child: made with its limits, joined by its first process, emptied
    and removed when it is closed."""

    def __init__(self, limits: Limits, hierarchies: Iterable[Hierarchy]) -> None:
        name = f"{PREFIX}{os.getpid()}-{next(_serial)}"
        self.directories: list[str] = []
        try:
            for hierarchy in hierarchies:
                directory = os.path.join(hierarchy.base, name)
                if directory not in self.directories:
                    os.mkdir(directory)
                    self.directories.append(directory)
                _write_limits(directory, hierarchy, limits.value(hierarchy.controller))
        except OSError:
            self.remove()
            raise

    def join_argv(self) -> list[str]:
        """What to put before a command so that it runs in these cgroups."""
        procs = [os.path.join(d, "cgroup.procs") for d in self.directories]
        return ["/bin/sh", "-c", JOIN_SCRIPT, "wm-cgroup", *procs, "--"]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for directory in self.directories:
            with contextlib.suppress(OSError, ValueError):
                found.update(int(p) for p in _read(f"{directory}/cgroup.procs").split())
        return found

    def remove(self) -> None:
        """Kill what is left in the cgroups, then remove them (bounded by EMPTY_WAIT_S)."""
        deadline = time.monotonic() + EMPTY_WAIT_S
        while self.directories and time.monotonic() < deadline:
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for directory in list(self.directories):
                with contextlib.suppress(FileNotFoundError):
                    try:
                        os.rmdir(directory)
                    except OSError:  # still populated: its processes are dying
                        continue
                self.directories.remove(directory)
            if self.directories:
                time.sleep(EMPTY_POLL_S)
        if self.directories:
            logger.warning("cgroups %s could not be removed", ", ".join(self.directories))


def cgroups_for(limits: Limits | None) -> Cgroups | None:
    """The cgroups of a new child with ``limits``, where this host has any."""
    hierarchies = placement()
    if limits is None or not hierarchies:
        return None
    return Cgroups(limits, hierarchies)
