"""Host side: what a sandboxed child is started with.

Kernel-level layers wrap the interpreter when the OS permits, probed once per host process.
With bubblewrap installed and user namespaces allowed (as root or not), the child runs under
``bwrap`` (see :mod:`engines.python.bwrap`): the layers ``BWRAP_LAYERS`` — user, mount, PID,
IPC, UTS and network namespaces, a filesystem of read-only binds plus a private tmpfs, no
capabilities and, with pyseccomp and libseccomp installed, a seccomp filter. Without
bubblewrap, the util-linux fallback:

* ``unshare --net`` — a fresh network namespace: no interface but a down loopback, so even
  code that got past the audit hook cannot reach the network. Needs CAP_SYS_ADMIN (root in
  this deployment); without it the child keeps the host's network and only the audit hook
  refuses sockets.
* ``setpriv --no-new-privs --bounding-set=-all --inh-caps=-all`` — the child (root in a root
  deployment) runs without any capability: no mknod of devices, no chroot, no raising of
  hard rlimits, no DAC override, no setuid binaries. Without CAP_SETPCAP only
  ``--no-new-privs`` is applied.
* ``setpriv --pdeathsig KILL`` — the child is killed when its host ends, also by SIGKILL or
  the OOM killer, which close nothing: a call hung in a sleep would otherwise outlive it for
  ever (bwrap's ``--die-with-parent`` does the same). The signal comes when the *thread*
  that spawned the child ends; the host spawns children from a pool process's main thread
  or a thread that lives as long as it (the sessions' server, a thread pool's workers). One
  spawned from a thread that ends sooner is killed with it, and replaced before its next
  call, as any child that died while idle. A host that ends before the child's prctl leaves
  a child that reads the end of its init pipe and exits.

Python 3.11 has no ``os.unshare`` and a ``preexec_fn`` is unsafe with threads, hence the
util-linux binaries. RLIMIT_NPROC is set but ignored by the kernel for host uid 0 (also in
bwrap's user namespace, whose uid maps to the host's); as root, the child's cgroup
(:mod:`engines.childproc.limits`) is what bounds its processes below the audit hook.

Also here: the paths the child may import from, read and list, and its rlimits.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engines.childproc import limits
from engines.python import bwrap
from wm.errors import ConfigurationError, InvalidCode, WorkerExecutionError
from wm.workersettings import WorkerSettings

logger = logging.getLogger(__name__)

#: MiB of address space per child unless the worker's settings say ``memory_mb``.
DEFAULT_MEMORY_MB = 512
#: Open files per child.
NOFILE_LIMIT = 64
#: bytes; largest file a worker may write into its directory.
FSIZE_LIMIT_BYTES = 16 * 1024 * 1024
#: CPU seconds of a child's lifetime, as a multiple of the message time limit (at least
#: MIN_CPU_LIMIT_S); the host recycles a child that used half of it.
CPU_LIMIT_FACTOR = 10
MIN_CPU_LIMIT_S = 60
#: seconds a probe of the isolation binaries may take.
PROBE_TIMEOUT_S = 5.0
#: Files outside the code directories that any child may read.
EXTRA_READ_ROOTS = ("/dev/null", "/dev/urandom", "/usr/share/zoneinfo")
#: Kernel-level layers the sandbox uses when the host permits them.
WANTED_LAYERS = (
    "user namespace",
    "mount namespace",
    "pid namespace",
    "ipc namespace",
    "uts namespace",
    "network namespace",
    "no capabilities",
    "dies with its host",
    "seccomp",
)
#: Layers bwrap adds by itself (``seccomp`` also needs the compiled filter).
BWRAP_LAYERS = WANTED_LAYERS[:-1]
#: Every layer name ``WM_SANDBOX_REQUIRE`` may list.
KNOWN_LAYERS = (*WANTED_LAYERS, "no new privileges")
#: Modules the bwrap probe child imports: the interpreter, its libraries and stdlib work.
_BWRAP_PROBE = "import json, resource, select, math, _struct"

#: Third-party modules the runner and the DevKit need inside the sandbox.
SANDBOX_DEPENDENCIES = ("cloudevents", "dateutil", "six")
#: Compiled standard-library modules whose location shows where this interpreter keeps them.
EXTENSION_PROBES = ("resource", "select", "_json", "_struct", "math", "_datetime", "binascii")
#: Standard-library modules the child cannot start without (``resource``: its rlimits).
REQUIRED_STDLIB = ("os", "json", "struct", "traceback", "dataclasses", "typing", "resource")
#: Directories of third-party code that some layouts keep inside the standard library's.
SITE_DIRS = ("site-packages", "dist-packages")
#: Prints the sys.path an interpreter starts with (run as ``python -I -S -c``).
_PATH_PROBE = "import json, sys; print(json.dumps(sys.path))"

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap.py")


@dataclass(frozen=True)
class Isolation:
    """Argv placed before the interpreter, and the names of the layers it adds."""

    prefix: tuple[str, ...]
    layers: tuple[str, ...]
    #: bwrap binary: when set, each child gets its own bwrap command (``child_wrapper``)
    #: and ``prefix`` is unused.
    bwrap: str | None = None
    #: compiled seccomp BPF program bwrap loads (None: no seccomp layer).
    seccomp: bytes | None = None


def _works(argv: list[str], pass_fds: tuple[int, ...] = ()) -> bool:
    try:
        done = subprocess.run(
            argv,
            env={},
            pass_fds=pass_fds,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _layer_options() -> list[tuple[str, list[str]]]:
    """(layer, argv) in order of preference; a weaker option only if the stronger failed."""
    options: list[tuple[str, list[str]]] = []
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if unshare:
        options.append(("network namespace", [unshare, "--net", "--"]))
    if setpriv:
        strict = [setpriv, "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--"]
        options.append(("no capabilities", strict))
        options.append(("no new privileges", [setpriv, "--no-new-privs", "--"]))
        options.append(("dies with its host", [setpriv, "--pdeathsig", "KILL", "--"]))
    return options


def _bwrap_isolation() -> Isolation | None:
    """bwrap layers, if a probe child starts under them (the full command, real binds)."""
    binary = shutil.which("bwrap")
    if binary is None:
        return None
    program = bwrap.seccomp_program()
    candidate = Isolation((), (), binary, program)
    try:
        paths = sandbox_paths(())
        with tempfile.TemporaryDirectory(prefix="wm-py-probe-") as directory:
            prefix, fds = child_wrapper(candidate, paths, directory)
            try:
                argv = [*prefix, bwrap.interpreter(), "-I", "-S", "-c", _BWRAP_PROBE]
                works = _works(argv, fds)
            finally:
                for fd in fds:
                    os.close(fd)
    except (OSError, subprocess.SubprocessError, WorkerExecutionError) as exc:
        logger.warning("python sandbox: bubblewrap unusable: %s", exc)
        return None
    if not works:
        logger.warning("python sandbox: %s does not start a sandboxed interpreter", binary)
        return None
    layers = BWRAP_LAYERS + (("seccomp",) if program is not None else ())
    return Isolation((), layers, binary, program)


def child_wrapper(
    isolation: Isolation, paths: SandboxPaths, directory: str
) -> tuple[list[str], tuple[int, ...]]:
    """(argv before the interpreter, fds the spawn must pass and then close) for one child.

    Without bwrap: the fixed ``prefix``. With it: a command binding ``paths`` read-only and
    a tmpfs at ``directory``, and a pipe holding the seccomp program.
    """
    if isolation.bwrap is None:
        return list(isolation.prefix), ()
    libs = bwrap.libraries(bwrap.interpreter(), paths.native_roots)
    fds: tuple[int, ...] = ()
    if isolation.seccomp is not None:
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, isolation.seccomp)
        finally:
            os.close(write_end)
        fds = (read_end,)
    argv = bwrap.command(
        isolation.bwrap,
        bwrap.interpreter(),
        paths.read_roots,
        libs,
        directory,
        fds[0] if fds else None,
    )
    return argv, fds


def interpreter(isolation: Isolation) -> str:
    """The interpreter path a child execs (the real file under bwrap, whose binds follow
    no symlink chain)."""
    return bwrap.interpreter() if isolation.bwrap is not None else sys.executable


def limit_layers() -> tuple[str, ...]:
    """What bounds a child's resources: its cgroups (:mod:`engines.childproc.limits`: its
    memory and process count with everything it starts), then its own rlimits. RLIMIT_NPROC
    binds no process of host uid 0, also not in a user namespace, so as root it is no layer."""
    own: tuple[str, ...] = ("rlimit address space", "rlimit cpu time")
    if os.geteuid() != 0:
        own += ("rlimit processes",)
    return (*limits.layers(), *own)


def _log_layers(layers: tuple[str, ...]) -> None:
    missing = [wanted for wanted in WANTED_LAYERS if wanted not in layers]
    logger.info("python sandbox isolation layers: %s", ", ".join(layers) or "none")
    if missing:
        logger.warning("python sandbox runs without: %s", ", ".join(missing))
    bounds = limit_layers()
    logger.info("python sandbox limit layers: %s", ", ".join(bounds))
    if not any(name.endswith(("pids", "processes")) for name in bounds):
        logger.warning(
            "python sandbox runs without a process limit: no cgroup pids controller here, and "
            "RLIMIT_NPROC binds nothing as root; only the audit hook refuses process creation"
        )
    if not any(name.endswith("memory") for name in bounds):
        logger.warning(
            "python sandbox runs without a total memory limit: no cgroup memory controller "
            "here; each of its processes is bound by RLIMIT_AS alone"
        )


def check_required(required: Iterable[str]) -> None:
    """Raise ConfigurationError unless every layer in ``required`` is active here."""
    unknown = [name for name in required if name not in KNOWN_LAYERS]
    if unknown:
        raise ConfigurationError(
            f"WM_SANDBOX_REQUIRE names unknown layers {unknown}; known: {', '.join(KNOWN_LAYERS)}"
        )
    layers = kernel_isolation().layers
    missing = [name for name in required if name not in layers]
    if missing:
        raise ConfigurationError(
            f"WM_SANDBOX_REQUIRE needs the sandbox layers {missing}, which this host does not "
            f"provide (active: {', '.join(layers) or 'none'}); install bubblewrap (and "
            "pyseccomp with libseccomp for 'seccomp') and allow user namespaces, or lower "
            "WM_SANDBOX_REQUIRE"
        )


@functools.cache
def kernel_isolation() -> Isolation:
    """Probe which kernel-level layers this host permits (once per process)."""
    wrapped = _bwrap_isolation()
    if wrapped is not None:
        _log_layers(wrapped.layers)
        return wrapped
    true = shutil.which("true") or "/bin/true"
    prefix: list[str] = []
    layers: list[str] = []
    for layer, argv in _layer_options():
        if layer == "no new privileges" and "no capabilities" in layers:
            continue
        if _works([*prefix, *argv, true]):
            prefix += argv
            layers.append(layer)
    _log_layers(tuple(layers))
    return Isolation(tuple(prefix), tuple(layers))


def _clean(path: str) -> str:
    """Absolute and lexically normal: the audit hook compares normalised paths by prefix and
    refuses any path with a ``..`` part, so a root spelled otherwise would match nothing."""
    return os.path.normpath(os.path.abspath(path))


def _spec_location(name: str) -> str | None:
    """The package directory or module file of top-level ``name`` (None if not found)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin in ("built-in", "frozen"):
        return None
    locations = spec.submodule_search_locations
    if locations:
        return _clean(str(next(iter(locations))))
    return _clean(str(spec.origin)) if spec.origin else None


def _required_location(name: str) -> str:
    location = _spec_location(name)
    if location is None:
        raise WorkerExecutionError(
            f"the Python sandbox cannot start: it needs the package {name!r}, which "
            f"{sys.executable} does not find (searched sys.path {sys.path}); install "
            "WorkManager with its dependencies into this environment"
        )
    return location


@functools.cache
def _interpreter_stdlib() -> tuple[str, ...]:
    """The standard-library path of the child's interpreter, as that interpreter computes it.

    The child starts as ``python -I -S``, whose ``sys.path`` is the standard library alone
    (zip, pure-Python directory, ``lib-dynload``), found from where the interpreter really
    is: the base installation's for a venv, ``/usr/lib/python3.X`` for Debian's, ``lib64``
    on some distributions. ``sysconfig`` can be wrong about it (inside a venv its
    ``platstdlib`` is the venv's own ``lib/python3.X``, which holds neither), and the host's
    own ``sys.path`` can be shadowed by PYTHONPATH or its working directory; the
    interpreter's own answer is neither.
    """
    argv = [sys.executable, "-I", "-S", "-c", _PATH_PROBE]
    try:
        done = subprocess.run(
            argv,
            env={},
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=True,
        )
        reported = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        raise WorkerExecutionError(
            f"the Python sandbox cannot start: {' '.join(argv)} does not report where its "
            f"standard library is: {detail}"
        ) from exc
    return tuple(dict.fromkeys(_clean(str(p)) for p in reported if os.path.exists(str(p))))


def _extension_dirs(stdlib: list[str]) -> list[str]:
    """The directories of ``stdlib`` that compiled standard-library modules load from.

    Looked up rather than assumed: ``lib-dynload`` is not at a fixed place, and a build may
    compile some of these modules into the interpreter (Debian's has ``select`` built in).
    """
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found = []
    for name in EXTENSION_PROBES:
        spec = importlib.machinery.PathFinder.find_spec(name, stdlib)
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(suffixes):
            found.append(_clean(os.path.dirname(origin)))
    return list(dict.fromkeys(found))


def _check_stdlib(stdlib: list[str]) -> None:
    """Refuse to start a child that would die importing the standard library, saying why."""
    for name in REQUIRED_STDLIB:
        if name in sys.builtin_module_names:
            continue
        if importlib.machinery.PathFinder.find_spec(name, stdlib) is None:
            raise WorkerExecutionError(
                f"the Python sandbox cannot start: the standard-library module {name!r} is not "
                f"in {stdlib}, the path {sys.executable} -I -S starts with (base prefix "
                f"{sys.base_prefix})"
            )


def _stdlib_read_roots(stdlib: list[str]) -> list[str]:
    """The standard library without the site directories some layouts keep inside it.

    A python.org, pyenv or uv-managed interpreter has ``site-packages`` inside
    ``lib/python3.X``; reading all of it would hand the child every installed package.
    """
    roots: list[str] = []
    for directory in stdlib:
        try:
            entries = sorted(os.listdir(directory))
        except OSError:  # a zip, or gone
            entries = []
        if not any(entry in SITE_DIRS for entry in entries):
            roots.append(directory)
            continue
        roots += [os.path.join(directory, e) for e in entries if e not in SITE_DIRS]
    return roots


def _third_party_location(name: str, stdlib: Iterable[str]) -> str | None:
    """Where an allowed package lives if it is not part of the standard library."""
    if name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return None
    location = _spec_location(name)
    if location is None or os.path.dirname(location) in stdlib:
        return None
    return location


@dataclass(frozen=True)
class SandboxPaths:
    """Where the child imports from (sys.path), reads, lists and loads native code."""

    sys_path: tuple[str, ...]
    read_roots: tuple[str, ...]
    list_roots: tuple[str, ...]
    native_roots: tuple[str, ...]
    packages: Mapping[str, str]
    third_party: bool


@functools.cache
def sandbox_paths(allowed: tuple[str, ...]) -> SandboxPaths:
    """Paths for a child whose worker may import ``allowed`` (plus the DevKit).

    Raises WorkerExecutionError, naming the module and where it was looked for, when this
    interpreter lacks something the child cannot start without.
    """
    stdlib = list(_interpreter_stdlib())
    _check_stdlib(stdlib)
    packages = {name: _required_location(name) for name in ("engines", "wm")}
    code = [_required_location(m) for m in SANDBOX_DEPENDENCIES] + list(packages.values())
    third_party = [loc for loc in (_third_party_location(n, stdlib) for n in allowed) if loc]
    parents = [os.path.dirname(loc) for loc in code + third_party]
    sys_path = tuple(dict.fromkeys(stdlib + parents))
    stdlib_reads = _stdlib_read_roots(stdlib)
    read_roots = tuple(dict.fromkeys([*stdlib_reads, *code, *third_party, *EXTRA_READ_ROOTS]))
    native = tuple(dict.fromkeys([*_extension_dirs(stdlib), *third_party]))
    return SandboxPaths(sys_path, read_roots, sys_path, native, packages, bool(third_party))


def _positive_number(settings: Mapping[str, Any], key: str, default: float) -> float:
    value = settings.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidCode(f"worker setting {key!r} must be a positive number, not {value!r}")
    return float(value)


def resource_limits(worker_settings: Mapping[str, Any], message_timeout_s: float) -> dict[str, int]:
    """The rlimits of a child (see ``runner.apply_limits``), from the worker's settings."""
    memory_mb = _positive_number(worker_settings, "memory_mb", DEFAULT_MEMORY_MB)
    ceiling_mb = WorkerSettings.of(worker_settings).max_memory_mb  # the core's limit, if set
    if ceiling_mb:
        memory_mb = min(memory_mb, ceiling_mb)
    cpu_default = max(MIN_CPU_LIMIT_S, CPU_LIMIT_FACTOR * message_timeout_s)
    cpu_s = _positive_number(worker_settings, "cpu_limit_s", cpu_default)
    return {
        "as_bytes": int(memory_mb * 1024 * 1024),
        "cpu_s": max(1, int(cpu_s)),
        "nofile": NOFILE_LIMIT,
        "fsize_bytes": FSIZE_LIMIT_BYTES,
        "nproc": 0,
        "core_bytes": 0,
    }
