"""The native engine (MIME ``application/x-native-dll``): workers shipped as a zip holding
``manifest.json`` and a shared library per architecture under ``runtimes/<rid>/native/``,
called through the C ABI of ``native_abi/virtufin_worker_api.h`` (seed 001), over cffi.

Modules: ``abi`` (the ABI's types, prototypes and constants, read from the header, which
ships with this package), ``package`` (the zip and its manifest), ``codec`` (CloudEvent and
WorkerResponse FlatBuffers, hand-written for speed; the flatc-generated code in
``native_abi/generated`` is the reference it is tested against), ``library`` (one loaded
library: Process, FreeResult, the optional Probe, the VirtufinHost callbacks), ``engine``
(the :class:`NativeEngine`), ``isolated`` and ``helper`` (isolation mode's native specifics,
host and helper sides of the pipe; the restarts are the engine-independent
:mod:`engines.isolation`, the process and its frames :mod:`engines.childproc`).

Operator notes:

* In-process by default, as the seed specifies: the call costs microseconds, but a crash in
  the library (segfault, illegal instruction, stack overflow) ends the Celery process that
  runs it (the broker delivers the message again; such redeliveries are counted and an
  event that keeps crashing is parked as WorkerCrashed), and a call past its time limit
  cannot be stopped (the node's watchdog publishes its ``worker.error`` at the limit; its
  answer is dropped as a timeout when it returns; until then it keeps its process).
  ``isolation: subprocess``
  (worker setting, or the manifest) runs the library in a helper process: a crash or a hang
  costs a failed delivery (retried, then dead-lettered), the helper is killed at the time
  limit and started again.
* The library's optional ``Probe`` export is the worker's health probe, bounded as Process
  is: in a helper it is killed at the time limit; in-process a late answer is dropped.
* Worker settings read by this engine: ``isolation``, and ``api_host`` / ``api_port`` (where
  ``host->gateway_call`` goes; the host must be in WM_GATEWAY_ALLOWED_HOSTS).
* VIRTUFIN_WORKER_ID, VIRTUFIN_WORKER_GROUP, VIRTUFIN_WORKER_TOPIC, VIRTUFIN_TENANT_ID are set
  before the library loads (in the helper's environment when isolated) and restored when the
  engine closes. They are process-wide, so a library reads them once when it initializes:
  each load is a fresh copy of the library, which sees its own worker's values.

cffi is imported only by this package; without it the engine is reported unavailable with
the extra to install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wm.extras import install_hint

if TYPE_CHECKING:
    from engines.native.engine import NativeEngine

__all__ = ["NativeEngine"]


def __getattr__(name: str) -> Any:
    if name == "NativeEngine":
        try:
            from engines.native.engine import NativeEngine
        except ModuleNotFoundError as exc:
            if exc.name != "cffi":
                raise
            raise ImportError(f"the native engine needs cffi: {install_hint('native')}") from exc
        return NativeEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
