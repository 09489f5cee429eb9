"""Host side: the bubblewrap command and seccomp filter that wrap one sandboxed child.

Under bubblewrap (``bwrap``) the child runs in its own user, mount, PID, IPC, UTS, cgroup
and network namespaces, with no capability and no further user namespace. Its filesystem
is a read-only tmpfs root holding only:

* read-only binds of the interpreter binary and the shared libraries it and the allowed
  native extensions link against (as their dynamic loader resolves them, which is what
  ``ldd`` lists: files, never whole library directories), the standard library (without
  its site directories), the DevKit and runner code, the allowed packages and
  ``/usr/share/zoneinfo``;
* ``/dev/null`` and ``/dev/urandom``, and no ``/proc`` at all;
* a private tmpfs of ``TMPFS_SIZE_BYTES`` at the child's working directory, the only
  writable place, with the worker's code file bound read-only inside it.

A seccomp filter (compiled by libseccomp through ``pyseccomp``) answers EPERM to socket
creation, tracing, mounts, keyrings, BPF, perf events, io_uring, namespace creation, kernel
modules and the other calls in ``DENIED_SYSCALLS``; other architectures' syscall tables are
killed (libseccomp's default for foreign ABIs, which closes the x32/i386 bypass).

bwrap's ``--die-with-parent`` kills the sandbox when the outer bwrap process ends, and the
outer one when the host ends, also by SIGKILL (the layer ``dies with its host``; the same
PR_SET_PDEATHSIG as the fallback's, with its caveat: see :mod:`engines.python.isolation`).
A close kills the child's process group.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

#: bytes; size of the child's private writable tmpfs (memory-backed: a worker cannot fill
#: the host's disk).
TMPFS_SIZE_BYTES = 64 * 1024 * 1024
#: uid and gid the child has inside its user namespace ("nobody"; mapped to the host's uid).
SANDBOX_UID = 65534
#: seconds one listing of shared libraries may take: the loader's of one file, or ``ldd``'s of
#: them all.
LIST_TIMEOUT_S = 30.0
#: Device nodes the child may open.
DEVICES = ("/dev/null", "/dev/urandom")
#: Syscalls refused with EPERM whatever their arguments.
DENIED_SYSCALLS = (
    "socket",
    "socketpair",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "unshare",
    "setns",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "iopl",
    "ioperm",
    "syslog",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "name_to_handle_at",
    "open_by_handle_at",
    "kcmp",
    "pidfd_open",
    "pidfd_getfd",
    "pidfd_send_signal",
    "lookup_dcookie",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "vhangup",
)
#: clone() flags that create namespaces (refused: the child may fork, never re-isolate).
CLONE_NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
#: ioctl pushing bytes into a terminal's input (refused; the child has no tty anyway).
TIOCSTI = 0x5412
#: A line of the loader's (and ``ldd``'s) listing naming a resolved library.
_LDD_PATH = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")
#: An ELF program header's type naming the program's dynamic loader, and the least size of
#: a 64-bit program header.
_PT_INTERP, _PHDR_SIZE = 3, 56
#: Bytes a loader's path may have (Linux's PATH_MAX).
_MAX_LOADER_PATH = 4096


def _pyseccomp() -> Any:
    """The pyseccomp module, or None when it (or libseccomp) is not installed."""
    try:
        return importlib.import_module("pyseccomp")
    except (ImportError, OSError) as exc:
        logger.warning("python sandbox: no seccomp filter (pyseccomp/libseccomp: %s)", exc)
        return None


def _add_rules(seccomp: Any, syscall_filter: Any) -> None:
    refuse = seccomp.ERRNO(errno.EPERM)
    for name in DENIED_SYSCALLS:
        try:
            syscall_filter.add_rule(refuse, name)
        except (OSError, ValueError, RuntimeError):  # unknown on this architecture
            logger.debug("python sandbox: seccomp does not know syscall %s here", name)
    for flag in CLONE_NAMESPACE_FLAGS:
        syscall_filter.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    syscall_filter.add_rule(refuse, "ioctl", seccomp.Arg(1, seccomp.EQ, TIOCSTI))
    # clone3 passes its flags in memory, out of a filter's reach: ENOSYS makes libc fall
    # back to clone(), whose flags the rules above do check.
    syscall_filter.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")


@functools.cache
def seccomp_program() -> bytes | None:
    """The compiled BPF program bwrap loads with ``--seccomp`` (None if unavailable)."""
    seccomp = _pyseccomp()
    if seccomp is None:
        return None
    try:
        syscall_filter = seccomp.SyscallFilter(seccomp.ALLOW)
        _add_rules(seccomp, syscall_filter)
        with tempfile.TemporaryFile() as handle:
            syscall_filter.export_bpf(handle)
            handle.seek(0)
            program: bytes = handle.read()
    except (OSError, ValueError, RuntimeError) as exc:
        logger.warning("python sandbox: cannot compile the seccomp filter: %s", exc)
        return None
    return program


def _shared_objects(roots: Iterable[str]) -> list[str]:
    """Native extension files under ``roots`` (their libraries must be bound too)."""
    found = []
    for root in roots:
        if os.path.isfile(root):
            continue
        for directory, _, files in os.walk(root):
            found += [os.path.join(directory, f) for f in files if ".so" in f]
    return found


@functools.cache
def libraries(interpreter: str, native_roots: tuple[str, ...]) -> tuple[str, ...]:
    """Shared libraries the interpreter and the native code under ``native_roots`` load, as
    the interpreter's dynamic loader resolves them.

    Each file is listed by that loader itself (``--list``, which glibc's and musl's loaders
    both take: they map the file and its libraries and run none of their code), as ``ldd``
    does: ``ldd``, a shell script, forks a dozen times a file, and over the standard
    library's extensions took 0.5 s of each node's start (1.6 s on a loaded host) where the
    loader takes 0.1 s.
    ``ldd`` lists them where the loader cannot be read off the interpreter (only a 64-bit
    little-endian ELF's is), cannot be run, or lists nothing of the interpreter."""
    files = [interpreter, *_shared_objects(native_roots)]
    loader = _loader(interpreter)
    own: set[str] = set()
    if loader is not None:
        with contextlib.suppress(OSError):  # not runnable: ldd's turn
            own = _found(_listed([loader, "--list", interpreter]))
    if loader is not None and own:
        found = own.union(*(_found(_listed([loader, "--list", f])) for f in files[1:]))
    else:
        ldd = shutil.which("ldd")
        if ldd is None:
            raise OSError("ldd is not installed: cannot list the interpreter's shared libraries")
        found = _found(_listed([ldd, *files]))
    return tuple(sorted(p for p in found if os.path.exists(p)))


def _listed(argv: list[str]) -> str:
    """What ``argv`` prints (a file that is no library of this machine prints nothing)."""
    return subprocess.run(
        argv,
        env={"LC_ALL": "C"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=LIST_TIMEOUT_S,
        check=False,
    ).stdout


def _found(listing: str) -> set[str]:
    return {os.path.normpath(m.group(1)) for m in _LDD_PATH.finditer(listing)}


def _loader(executable: str) -> str | None:
    """The dynamic loader a 64-bit little-endian ELF ``executable`` names (its
    ``PT_INTERP``), if that is an absolute path to a file; else None, also for a file that
    is no such ELF or is malformed."""
    try:
        with open(executable, "rb") as handle:
            head = handle.read(64)
            if len(head) < 64 or head[:6] != b"\x7fELF\x02\x01":  # ELF, 64-bit, LE
                return None
            (table_at,) = struct.unpack_from("<Q", head, 32)
            entry_size, entries = struct.unpack_from("<HH", head, 54)
            if entry_size < _PHDR_SIZE:
                return None
            handle.seek(table_at)
            table = handle.read(entry_size * entries)
            for at in range(0, len(table) - entry_size + 1, entry_size):
                if struct.unpack_from("<I", table, at)[0] != _PT_INTERP:
                    continue
                (offset,) = struct.unpack_from("<Q", table, at + 8)
                (size,) = struct.unpack_from("<Q", table, at + 32)
                if not 0 < size <= _MAX_LOADER_PATH:
                    return None
                handle.seek(offset)
                path = os.fsdecode(handle.read(size).split(b"\0", 1)[0])
                return path if os.path.isabs(path) and os.path.isfile(path) else None
    except (OSError, ValueError, OverflowError, struct.error):
        return None
    return None


def _outermost(paths: Iterable[str]) -> list[str]:
    """``paths`` without those inside another one, parents first (binds nest in order)."""
    kept: list[str] = []
    for path in sorted(set(paths)):
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def _read_only_binds(interpreter: str, read_roots: Iterable[str], libs: Iterable[str]) -> list[str]:
    argv: list[str] = []
    wanted = [interpreter, *libs, *(r for r in read_roots if r not in DEVICES)]
    for path in _outermost(p for p in wanted if os.path.exists(p)):
        argv += ["--ro-bind", path, path]
    for device in DEVICES:
        argv += ["--dev-bind", device, device]
    return argv


def command(
    bwrap: str,
    interpreter: str,
    read_roots: Iterable[str],
    libs: Iterable[str],
    directory: str,
    seccomp_fd: int | None,
) -> list[str]:
    """The bwrap argv placed before ``interpreter`` for a child whose cwd is ``directory``.

    Files already in ``directory`` (the worker's code) are bound read-only over the tmpfs.
    """
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
    ]
    argv += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
    argv += ["--cap-drop", "ALL", "--clearenv"]
    argv += _read_only_binds(interpreter, read_roots, libs)
    argv += ["--size", str(TMPFS_SIZE_BYTES), "--tmpfs", directory]
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        argv += ["--ro-bind", path, path]
    argv += ["--remount-ro", "/", "--chdir", directory]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return [*argv, "--"]


def interpreter() -> str:
    """The interpreter file the child execs: the real binary behind a venv's symlink."""
    return os.path.realpath(sys.executable)
