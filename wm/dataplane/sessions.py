"""This process as an engine instance of session affinity (``wm.state.affinity``): the
thread that serves the calls other processes hand it, the lock that runs them one at a time
with this process's own calls of the same worker, and :class:`ElsewhereEngine`, an engine
whose calls run on the instance a session is bound to.

The thread starts with the first delivery of a session in this process, so a process that
serves no worker with a ``session_key`` runs none. It renews the instance's key every
:data:`~wm.state.affinity.BEAT_S`; when the process ends the key lapses, and the sessions
bound here rebind on their next event. A call handed here runs on this process's engine of
the worker (loaded as a delivery would load it), so it sees the state the code kept in
memory; the caller records and publishes the outcome, so every guarantee of the delivery
(its recorded outcome, group lock, retries, dead letter) stays with the delivery's message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from wm import errors
from wm.dataplane import runtime
from wm.dataplane.runtime import Runtime
from wm.dataplane.watchdog import OVERRUN_GRACE_S
from wm.engine import WORKER_ANSWER, Engine, Outputs
from wm.errors import WorkerExecutionError, WorkerTimeout
from wm.events import CloudEvent, decode, encode
from wm.state.affinity import BEAT_S, Affinity

logger = logging.getLogger(__name__)

_guard = threading.Lock()
#: Per worker: held while this process runs a call of a worker with sessions.
_calls: dict[str, threading.Lock] = {}
#: Instances a call is handed to in turn, each gone before it answered, before it fails.
HOPS = 3
#: The process whose serving thread runs (none after a fork).
_serving_pid = 0


@contextlib.contextmanager
def calling(worker_id: str) -> Iterator[None]:
    """Calls of one worker in this process, one at a time (its own and those handed here)."""
    with _guard:
        lock = _calls.setdefault(worker_id, threading.Lock())
    with lock:
        yield


def serve(rt: Runtime) -> None:
    """Make this process an instance that other processes may hand calls to (once)."""
    global _serving_pid
    with _guard:
        if _serving_pid == os.getpid():
            return
        _serving_pid = os.getpid()
        _calls.clear()
    Affinity(rt.settings).renew(rt.node)
    thread = threading.Thread(target=_serve, args=(rt,), name="wm-sessions", daemon=True)
    thread.start()


def _serve(rt: Runtime) -> None:
    affinity = Affinity(rt.settings)
    while True:
        try:
            affinity.renew(rt.node)
            request = affinity.next_call(rt.node)
            if request is not None:
                affinity.answer(request["reply"], _run(rt, request))
        except Exception:  # Redis away for a moment: the callers wait or run it themselves
            logger.exception("session affinity: serving calls of %s failed", rt.node)
            time.sleep(BEAT_S)


def _run(rt: Runtime, request: dict[str, Any]) -> dict[str, Any]:
    """Run one handed call on this process's engine of its worker; its answer."""
    if time.time() > request["deadline"]:
        return _error(WorkerTimeout("the call was handed over too late to run"))
    meta = rt.directory.get(request["worker_id"])
    if meta is None:
        return _error(errors.WorkerNotFound(f"worker {request['worker_id']} does not exist"))
    try:
        engine, temporary = rt.engines.engine(meta, int(request["version"]))
        try:
            timeout_s = float(request["timeout_s"])
            with calling(meta.id):
                if time.time() > request["deadline"]:  # the caller no longer waits for it
                    return _error(WorkerTimeout("the call waited too long here to run"))
                with _watched(rt, engine, meta.id, timeout_s):
                    produced = engine.process(decode(request["event"]), timeout_s)
        finally:
            if temporary:
                engine.close()
    except Exception as exc:  # the caller judges it as its own call's failure
        return _error(exc)
    return {
        "events": [encode(event) for event in produced],
        "worker_error": getattr(produced, "worker_error", None),
        "error_type": getattr(produced, "error_type", None),
        "done": getattr(produced, "done", None),
    }


def _watched(
    rt: Runtime, engine: Engine, worker_id: str, timeout_s: float
) -> contextlib.AbstractContextManager[object]:
    """A handed call the engine cannot stop is watched as a delivery's own: past its limit
    and a grace the process ends (a pool process; the node starts another), its sessions
    rebind, and the caller's message is delivered again as after a crash."""
    if engine.stops_calls():
        return contextlib.nullcontext()
    what = f"a handed call of worker {worker_id}"
    overrun = _nothing if runtime.POOL_CHILD else None
    return rt.watchdog.watch(time.monotonic() + timeout_s + OVERRUN_GRACE_S, what, overrun)


def _nothing() -> None:
    """Nothing to record: the caller's message is delivered again."""


def _error(exc: Exception) -> dict[str, Any]:
    return {
        "error": type(exc).__name__,
        "message": str(exc),
        "error_type": getattr(exc, "error_type", None),
    }


def _raise(answer: dict[str, Any]) -> None:
    """Raise the error an instance answered with, as the caller's own call would have."""
    name, message = str(answer["error"]), str(answer["message"])
    known = getattr(errors, name, None)
    if isinstance(known, type) and issubclass(known, WorkerExecutionError):
        raise known(message, error_type=answer.get("error_type"))
    if isinstance(known, type) and issubclass(known, errors.WorkManagerError):
        raise known(message)
    raise WorkerExecutionError(message, error_type=answer.get("error_type") or name)


class ElsewhereEngine(Engine):
    """Runs each call on ``instance``, the one the session is bound to. When that instance
    goes away (or does not answer in time), ``rebind`` moves the binding from it and names
    the instance bound now: this process (the call runs here, with ``here``) or another one,
    asked in turn, at most :data:`HOPS` times."""

    def __init__(
        self,
        rt: Runtime,
        worker_id: str,
        version: int,
        instance: str,
        rebind: Callable[[str], str],
        here: Callable[[CloudEvent, float], list[CloudEvent]],
    ) -> None:
        super().__init__(rt.settings)
        self.rt, self.worker_id, self.version = rt, worker_id, version
        self.instance, self.rebind, self.here = instance, rebind, here
        #: an instance answered the call (None: not yet; False: it ran here instead)
        self.answered: bool | None = None

    def stops_calls(self) -> bool:
        return True  # the wait for the answer is bounded

    def process(self, event: CloudEvent, timeout_s: float) -> list[CloudEvent]:
        request = {
            "worker_id": self.worker_id,
            "version": self.version,
            "event": encode(event),
            "timeout_s": timeout_s,
            "deadline": time.time() + timeout_s + OVERRUN_GRACE_S,
        }
        # the instance may finish a call of its own first: twice the limit, plus grace
        wait_s = 2 * timeout_s + OVERRUN_GRACE_S
        for _ in range(HOPS):
            answer = Affinity(self.rt.settings).ask(self.instance, request, wait_s)
            if answer is not None:
                self.answered = True
                return _outputs(answer)
            logger.warning(
                "session affinity: instance %s of worker %s is gone or did not answer within "
                "%g s; rebinding its session",
                self.instance,
                self.worker_id,
                wait_s,
            )
            self.instance = self.rebind(self.instance)
            if self.instance == self.rt.node:
                self.answered = False
                return self.here(event, timeout_s)
        raise WorkerTimeout(
            f"session affinity: no instance of worker {self.worker_id} answered the call "
            f"after {HOPS} rebindings"
        )


def _outputs(answer: dict[str, Any]) -> list[CloudEvent]:
    """The events an instance answered with (or the error it raised, raised here)."""
    if "error" in answer:
        _raise(answer)
    produced = [decode(raw) for raw in answer["events"]]
    if answer["worker_error"] is None and answer["done"] is None:
        return produced
    return Outputs(
        produced,
        worker_error=answer["worker_error"],
        done=answer["done"],
        error_type=answer["error_type"] or WORKER_ANSWER,
    )
