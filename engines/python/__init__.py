"""The Python engine (MIME ``text/x-python``): worker code runs in a persistent, sandboxed
subprocess that the host talks to over length-prefixed JSON frames.

Host side: :mod:`engines.python.engine` (the :class:`PythonEngine`), ``process`` (one child),
``isolation`` (kernel-level layers, paths, rlimits); gateway calls go through
:mod:`wm.devkit.gateway`. Sandbox side: ``bootstrap`` (entry script), ``runner`` (message loop) and
``sandbox`` (import guard, restricted builtins, audit hook). ``protocol`` is shared.

Operator notes:

* Contract: the code defines ``process(event)`` (``async def`` allowed if it awaits only
  coroutines) or one ``wm.devkit.WorkerBase`` subclass constructible without arguments; it
  returns a CloudEvent, a list or tuple of them, or None. Optional health probe: a
  top-level ``probe()`` function or the subclass's ``probe(self)``, run in the sandbox like a
  message (same time limit); a false answer or an exception is a failed probe.
* Settings: ``PYTHON_ALLOWED_PACKAGES`` (top-level names; ``wm.devkit`` is always allowed),
  ``MESSAGE_HANDLING_TIMEOUT_SECONDS`` (per message; loading gets 10 s more),
  ``WM_GATEWAY_ALLOWED_HOSTS`` and ``WM_GATEWAY_TIMEOUT_S`` for gateway calls.
* Worker settings read by this engine: ``memory_mb`` (address space, default 512) and
  ``cpu_limit_s`` (CPU seconds over a child's life, default max(60, 10 × the timeout); a
  child past half of it is replaced between messages). Other keys are ignored.
* A worker's cwd is a private temporary directory: the only writable place (16 MiB per
  file). Reads are limited to the standard library, the allowed packages and the DevKit.
  The environment is empty. Threads are unsupported: one left running ends the child.
* Gateway: ``POST http://{host}:{port}/{service}/{method}`` with a JSON body, performed by
  the host (see :mod:`wm.devkit.api`).
* Layers and what each protects are described in ``sandbox`` and ``isolation``; the
  network namespace, the capability drop and the child's death with its host are used when
  the OS permits and logged at start. Residual risks: packages with raw memory access
  (numpy, anything exposing ctypes) or a CPython memory-safety bug can bypass the in-process
  hook, leaving the kernel layers; a worker can fill the disk of its temporary directory
  within its time limit; as root, RLIMIT_NPROC does not apply, and only the child's cgroup
  (:mod:`engines.childproc.limits`, ``WM_SANDBOX_MAX_PROCESSES``) bounds its processes below
  the audit hook. Running the host as a non-root user, or the sandbox in a read-only mount
  namespace, narrows these further.

The engine class is imported lazily: the sandboxed child imports modules of this package and
must not pull in the host side (``subprocess``, ``threading``, ``http.client``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engines.python.engine import PythonEngine

__all__ = ["PythonEngine"]


def __getattr__(name: str) -> Any:
    if name == "PythonEngine":
        from engines.python.engine import PythonEngine

        return PythonEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
