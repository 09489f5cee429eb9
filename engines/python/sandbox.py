"""Sandbox side: the import guard, the restricted builtins and the audit hook.

Layers, from policy to boundary:

* **Import guard and restricted builtins** (policy). Worker code runs with its own
  ``__builtins__`` whose ``__import__`` admits only ``PYTHON_ALLOWED_PACKAGES`` and
  ``wm.devkit``, even for modules the runner already imported; ``exec``, ``eval``,
  ``compile``, ``breakpoint`` and ``input`` are absent. Object-graph walks
  (``().__class__.__base__.__subclasses__()``) still reach loaded modules, so this layer
  decides what well-behaved code imports, not what hostile code can touch.
* **Audit hook** (boundary for effects). Installed last, it refuses process creation,
  signals, sockets, ctypes, writes outside the worker's directory, reads outside the code the
  worker needs, native extensions outside the allowed directories, subinterpreters, new audit
  hooks, tracing, ``gc`` object hunts, code-object forging and frame access from worker code.
  Reaching a function object by a walk does not help: the effect itself is refused.

The hook has no mutable state reachable from Python. It and its helpers use no globals and no
builtins: everything they need is bound as positional defaults (a tuple, replacing it raises
an audit event the hook refuses) holding only immutable values — frozensets, tuples, strings,
builtin functions and types. Worker code that reaches the hook's module can therefore not
switch it off by rebinding a name. Paths from audit arguments are converted to exact ``str``
with C-level calls, so a ``str`` subclass cannot lie about its value, and path-like objects
(whose ``__fspath__`` could answer differently twice) are refused.

Known limits (documented for operators): a package with raw memory access (numpy strides,
ctypes pointers) or a CPython memory-safety bug can corrupt the interpreter and bypass any
in-process hook; the kernel-level layers (network namespace, no capabilities, death with its
host, rlimits, the child's cgroups, empty environment, own process group, host-side timeout)
are what remains in that case.
"""

from __future__ import annotations

import builtins
import os
import sys
from collections.abc import Callable, Iterable
from types import CodeType
from typing import Any

#: Top-level module of the DevKit, always importable by worker code (with its submodules).
DEVKIT_MODULE = "wm.devkit"

#: Builtins worker code does not get.
REMOVED_BUILTINS = frozenset(
    {
        "exec",
        "eval",
        "compile",
        "breakpoint",
        "input",
        "help",
        "exit",
        "quit",
        "copyright",
        "credits",
        "license",
        "__loader__",
        "__spec__",
    }
)

#: Audit events refused whoever raises them.
DENIED_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.spawn",
        "os.startfile",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "subprocess.Popen",
        "pty.spawn",
        "os.chdir",
        "os.chown",
        "os.lchown",
        "os.chflags",
        "os.lchflags",
        "os.link",
        "os.symlink",
        "os.setxattr",
        "os.removexattr",
        "resource.setrlimit",
        "resource.prlimit",
        "sys.settrace",
        "sys.setprofile",
        "sys._current_frames",
        "sys._current_exceptions",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "code.__new__",
        "function.__new__",
        "cpython.PyInterpreterState_New",
        "cpython.PyFile_SetOpenCodeHook",
        "sqlite3.connect",
        "sqlite3.enable_load_extension",
        "sqlite3.load_extension",
        "webbrowser.open",
        "urllib.Request",
        "mmap.__new__",
    }
)

#: Prefixes of audit events refused whoever raises them.
DENIED_PREFIXES = (
    "socket.",
    "ctypes.",
    "syslog.",
    "ftplib.",
    "smtplib.",
    "telnetlib.",
    "imaplib.",
    "poplib.",
    "nntplib.",
    "http.client.",
)

#: Native extension modules that may never be loaded in the sandbox.
DENIED_EXTENSIONS = frozenset(
    {
        "_posixsubprocess",
        "_socket",
        "_ssl",
        "_cffi_backend",
        "mmap",
        "_multiprocessing",
        "_posixshmem",
        "_xxsubinterpreters",
        "_xxinterpchannels",
        "_testcapi",
        "_testinternalcapi",
        "_testbuffer",
        "_testmultiphase",
        "_testimportmultiple",
        "_testsinglephase",
        "_ctypes_test",
        "_tkinter",
        "_curses",
        "_curses_panel",
        "readline",
        "termios",
        "_lsprof",
        "_xxtestfuzz",
        "resource",
        "fcntl",
        "_dbm",
        "_gdbm",
        "_sqlite3",
    }
)

#: Attributes whose read hands out a frame object.
FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})

#: os.open flags that make an open a write.
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

#: Unaudited functions removed from os/posix and _signal before worker code runs.
STRIPPED = {
    "posix": ("mknod", "mkfifo", "pidfd_open", "chroot"),
    "os": ("mknod", "mkfifo", "pidfd_open", "chroot"),
    "_signal": ("pidfd_send_signal", "pthread_kill"),
}

#: Builtin modules imported before the seal (none can be created afterwards).
PRELOADED_BUILTINS = (
    "_ast",
    "_string",
    "_symtable",
    "_tokenize",
    "atexit",
    "errno",
    "gc",
    "itertools",
    "_locale",
    "_stat",
)

_UNSET: Any = None


class SandboxViolation(PermissionError):
    """Raised inside the sandbox when worker code attempts an operation the sandbox refuses."""


class FrameAccessDenied(SandboxViolation, ValueError):
    """Raised for frame access from worker code.

    Also a ValueError: the standard library treats ValueError from ``sys._getframe`` as
    "no frame available" (namedtuple, typing, enum), so their use from worker code keeps
    working.
    """


class SandboxTampering(BaseException):
    """Raised when worker code tries to add an audit hook.

    CPython silently drops an ``Exception`` raised by a hook for ``sys.addaudithook``; a
    BaseException propagates, so the attempt is visible, and the runner ends the child.
    """


# --- import guard -------------------------------------------------------------------------


def import_refusal(name: str) -> str:
    """The message of a refused import."""
    top = name.partition(".")[0]
    return (
        f"import of {name!r} is not allowed in a WorkManager Python worker; "
        f"add {top!r} to PYTHON_ALLOWED_PACKAGES"
    )


def make_import_guard(
    allowed: Iterable[str], real_import: Callable[..., Any]
) -> Callable[..., Any]:
    """An ``__import__`` that admits only ``allowed`` top-level names and the DevKit."""
    allowed_names = frozenset(allowed)

    def guarded_import(
        name: str,
        globals: Any = None,
        locals: Any = None,
        fromlist: Any = (),
        level: int = 0,
    ) -> Any:
        if level:
            raise ImportError("relative imports are not supported in a WorkManager Python worker")
        if not isinstance(name, str):
            raise TypeError("module name must be a string")
        name = str.__getitem__(name, slice(None))
        devkit = name == DEVKIT_MODULE or name.startswith(DEVKIT_MODULE + ".")
        if not devkit and name.partition(".")[0] not in allowed_names:
            raise ImportError(import_refusal(name), name=name)
        return real_import(name, globals, locals, fromlist, 0)

    return guarded_import


def restricted_builtins(guard: Callable[..., Any]) -> dict[str, Any]:
    """The ``__builtins__`` of worker code: the real ones minus escapes, plus the guard."""
    namespace = {k: v for k, v in vars(builtins).items() if k not in REMOVED_BUILTINS}
    namespace["__import__"] = guard
    return namespace


# --- audit hook ---------------------------------------------------------------------------
# Every function below runs inside the audit hook: no globals, no builtins (see module doc).


def _normalize(
    path: Any,
    cwd: str = _UNSET,
    _isinstance: Any = isinstance,
    _str: Any = str,
    _bytes: Any = bytes,
    _full: Any = slice(None),
) -> str | None:
    """Absolute, lexically normalised exact-str path; None for what cannot be judged."""
    if _isinstance(path, _bytes):
        text = _bytes.decode(path, "utf-8", "surrogateescape")
    elif _isinstance(path, _str):
        text = _str.__getitem__(path, _full)
    else:
        return None
    if "\x00" in text:
        return None
    if not text.startswith("/"):
        text = cwd + "/" + text
    parts = []
    for part in text.split("/"):
        if part == "..":
            return None
        if part and part != ".":
            parts.append(part)
    return "/" + "/".join(parts)


def _within(path: str, roots: tuple[str, ...]) -> bool:
    for root in roots:  # noqa: SIM110 - any() is a builtin, which the hook may not use
        if path == root or path.startswith(root + "/"):
            return True
    return False


def _deny_if_worker_frames(
    what: str,
    _getframe: Any = sys._getframe,
    worker_file: str = _UNSET,
    _error: Any = FrameAccessDenied,
) -> None:
    """Refuse ``what`` when worker code is on the calling stack."""
    frame = _getframe(0).f_back
    while frame is not None:
        if frame.f_code.co_filename == worker_file:
            raise _error(what + " is not allowed in a WorkManager Python worker")
        frame = frame.f_back


def _on_getattr(
    event: str,
    args: tuple[Any, ...],
    _attributes: frozenset[str] = FRAME_ATTRIBUTES,
    _deny: Any = _deny_if_worker_frames,
) -> None:
    if args[1] in _attributes:
        _deny("access to " + args[1])


def _on_setattr(
    event: str,
    args: tuple[Any, ...],
    protected: tuple[Any, ...] = (),
    _error: Any = SandboxViolation,
) -> None:
    if args[1] == "__code__" or args[0] in protected:
        raise _error("changing " + args[1] + " is not allowed in a WorkManager Python worker")


def _on_getframe(
    event: str,
    args: tuple[Any, ...],
    own_code: Any = _UNSET,
    _deny: Any = _deny_if_worker_frames,
) -> None:
    if args[0].f_code is not own_code:
        _deny("sys._getframe")


def _on_open(
    event: str,
    args: tuple[Any, ...],
    fs: tuple[Any, ...] = _UNSET,
    _normalize: Any = _normalize,
    _within: Any = _within,
    _type: Any = type,
    _int: Any = int,
    _error: Any = SandboxViolation,
    _write_flags: int = WRITE_FLAGS,
) -> None:
    read_roots, write_roots = fs[0], fs[1]
    path, mode, flags = args
    if _type(path) is _int:
        return
    if _type(flags) is not _int:
        raise _error("open with unknown flags is not allowed in a WorkManager Python worker")
    norm = _normalize(path)
    if norm is None:
        raise _error("open() needs a plain str or bytes path without '..' in the sandbox")
    if _within(norm, write_roots):
        return
    if flags & _write_flags:
        raise _error("writing " + norm + " is not allowed: only the worker's directory is writable")
    if mode is None or not _within(norm, read_roots):
        raise _error("reading " + norm + " is not allowed in a WorkManager Python worker")


def _on_listdir(
    event: str,
    args: tuple[Any, ...],
    fs: tuple[Any, ...] = _UNSET,
    _normalize: Any = _normalize,
    _within: Any = _within,
    _type: Any = type,
    _int: Any = int,
    _error: Any = SandboxViolation,
) -> None:
    read_roots, write_roots, list_roots = fs[0], fs[1], fs[2]
    path = args[0]
    if path is None or _type(path) is _int:
        return
    norm = _normalize(path)
    if norm is None or not (norm in list_roots or _within(norm, read_roots + write_roots)):
        raise _error(event + " of this path is not allowed in a WorkManager Python worker")


def _on_write_path(
    event: str,
    args: tuple[Any, ...],
    fs: tuple[Any, ...] = _UNSET,
    _normalize: Any = _normalize,
    _within: Any = _within,
    _type: Any = type,
    _int: Any = int,
    _error: Any = SandboxViolation,
) -> None:
    """os.mkdir/rmdir/remove/chmod/utime/truncate/rename: only inside the worker's directory."""
    if event == "os.rename":
        paths, dir_fds = args[:2], args[2:]
    elif event == "os.truncate":
        if _type(args[0]) is _int:
            return
        paths, dir_fds = args[:1], ()
    else:
        paths, dir_fds = args[:1], args[-1:]
    for dir_fd in dir_fds:
        if dir_fd is not None and dir_fd != -1:
            raise _error(event + " with dir_fd is not allowed in a WorkManager Python worker")
    write_roots = fs[1]
    for path in paths:
        norm = _normalize(path)
        if norm is None or not _within(norm, write_roots):
            raise _error(event + " outside the worker's directory is not allowed")


def _on_import(
    event: str,
    args: tuple[Any, ...],
    fs: tuple[Any, ...] = _UNSET,
    _normalize: Any = _normalize,
    _within: Any = _within,
    _extensions: frozenset[str] = DENIED_EXTENSIONS,
    _error: Any = SandboxViolation,
) -> None:
    """Native extensions load only from the allowed directories and never from a deny list."""
    if args[1] is None:
        return
    norm = _normalize(args[1])
    if norm is None or not _within(norm, fs[3]):
        raise _error("loading native code from this path is not allowed in the sandbox")
    base = norm.rpartition("/")[2].partition(".")[0]
    if base in _extensions:
        raise _error("loading the extension module " + base + " is not allowed in the sandbox")


def _on_dlopen(event: str, args: tuple[Any, ...], _error: Any = SandboxViolation) -> None:
    """ctypes' own import opens the main program (None); nothing else may be opened."""
    if args[0] is not None:
        raise _error("ctypes.dlopen is not allowed in a WorkManager Python worker")


def _on_addaudithook(event: str, args: tuple[Any, ...], _error: Any = SandboxTampering) -> None:
    raise _error("adding an audit hook is not allowed in a WorkManager Python worker")


def audit_hook(
    event: str,
    args: tuple[Any, ...],
    handlers: tuple[tuple[frozenset[str], Any], ...] = (),
    _denied: frozenset[str] = DENIED_EVENTS,
    _prefixes: tuple[str, ...] = DENIED_PREFIXES,
    _error: Any = SandboxViolation,
) -> None:
    """The sandbox's audit hook (see module doc for why it is written this way)."""
    for events, handler in handlers:
        if event in events:
            handler(event, args)
            return
    if event in _denied or event.startswith(_prefixes):
        raise _error(event + " is not allowed in a WorkManager Python worker")


_HANDLERS = (
    (frozenset({"object.__getattr__"}), _on_getattr),
    (frozenset({"open"}), _on_open),
    (frozenset({"import"}), _on_import),
    (frozenset({"sys._getframe"}), _on_getframe),
    (frozenset({"object.__setattr__", "object.__delattr__"}), _on_setattr),
    (frozenset({"os.listdir", "os.scandir", "os.getxattr", "os.listxattr"}), _on_listdir),
    (
        frozenset(
            {
                "os.mkdir",
                "os.rmdir",
                "os.remove",
                "os.chmod",
                "os.utime",
                "os.truncate",
                "os.rename",
            }
        ),
        _on_write_path,
    ),
    (frozenset({"ctypes.dlopen"}), _on_dlopen),
    (frozenset({"sys.addaudithook"}), _on_addaudithook),
)

#: Every function the hook runs; their defaults and code may never change once sealed.
HOOK_FUNCTIONS: tuple[Callable[..., Any], ...] = (
    audit_hook,
    _normalize,
    _within,
    _deny_if_worker_frames,
    *(h for _, h in _HANDLERS),
)


def _rebind(function: Any, **values: Any) -> None:
    """Set named positional defaults of ``function`` (before the seal only)."""
    code = function.__code__
    names = code.co_varnames[: code.co_argcount]
    defaults = list(function.__defaults__ or ())
    offset = len(names) - len(defaults)
    for name, value in values.items():
        defaults[names.index(name) - offset] = value
    function.__defaults__ = tuple(defaults)


def seal(
    *,
    read_roots: Iterable[str],
    list_roots: Iterable[str],
    native_roots: Iterable[str],
    write_root: str,
    worker_file: str,
    extra_denied_extensions: Iterable[str] = (),
) -> None:
    """Bind the policy into the hook functions and install the hook. Irreversible."""
    fs = (tuple(read_roots), (write_root,), frozenset(list_roots), tuple(native_roots))
    _rebind(_normalize, cwd=write_root)
    _rebind(_on_import, _extensions=DENIED_EXTENSIONS | frozenset(extra_denied_extensions))
    for handler in (_on_open, _on_listdir, _on_write_path, _on_import):
        _rebind(handler, fs=fs)
    _rebind(_deny_if_worker_frames, worker_file=worker_file)
    _rebind(_on_getframe, own_code=_deny_if_worker_frames.__code__)
    _rebind(_on_setattr, protected=HOOK_FUNCTIONS)
    _rebind(audit_hook, handlers=_HANDLERS)
    sys.addaudithook(audit_hook)


# --- before the seal ----------------------------------------------------------------------


def _refuse_builtin_creation(spec: Any) -> Any:
    raise ImportError(f"builtin module {spec.name!r} cannot be created in the sandbox")


def strip_interpreter() -> None:
    """Preload builtin modules, remove unaudited escapes, forbid re-creating builtins.

    Builtin modules re-created through ``_imp.create_builtin`` would bring stripped
    functions back, so after this no builtin module can be created at all.
    """
    for name in PRELOADED_BUILTINS:
        __import__(name)
    for module_name, names in STRIPPED.items():
        module = sys.modules.get(module_name)
        for name in names:
            if module is not None and hasattr(module, name):
                delattr(module, name)
    vars(sys.modules["_imp"])["create_builtin"] = _refuse_builtin_creation


def code_of(function: Callable[..., Any]) -> CodeType:
    """The code object of ``function`` (used by tests to inspect the hook's bytecode)."""
    code: CodeType = getattr(function, "__code__")  # noqa: B009 - typed access to __code__
    return code
