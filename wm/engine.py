"""The engine contract (``load``, ``process``, ``close``) and the registry that finds an
engine by MIME type through the ``wm.engines`` entry points. Engines live in the ``engines``
package (or any distribution) and import this module; the core never imports them."""

from __future__ import annotations

import difflib
import logging
import os
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any, ClassVar

from wm.config import Settings
from wm.errors import EngineNotFound, EngineUnavailable
from wm.events import CloudEvent
from wm.names import DEFAULT_TENANT
from wm.workersettings import SettingRule

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What an engine may know about the worker whose code it runs."""

    worker_id: str
    topic: str
    group: str | None = None
    version: int = 1
    sha256: str = ""
    name: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    #: The tenant it runs under; ``topic`` is the topic as its tenant names it.
    tenant: str = DEFAULT_TENANT


#: The ``error_type`` of an error a worker answered with (its error response) rather than raised.
WORKER_ANSWER = "WorkerAnswer"


class Outputs(list[CloudEvent]):
    """What ``process`` may return instead of a plain list: the events to publish, and in
    ``worker_error`` the error the worker answered with (its error response is among the
    events). Such an answer is no failed delivery: it is recorded and published like any
    outcome, never retried, and the delivery reports it as a ``worker.error`` lifecycle event
    of ``error_type``: :data:`WORKER_ANSWER`, or the type of the exception the worker's base
    class answered for its code (a .NET ``CommandWorker`` handler's).
    ``done``: the worker's code declared it has done its work (for this reason); once the
    outputs are published the worker is ``finished``.
    """

    def __init__(
        self,
        events: Iterable[CloudEvent] = (),
        worker_error: str | None = None,
        done: str | None = None,
        error_type: str = WORKER_ANSWER,
    ):
        super().__init__(events)
        self.worker_error = worker_error
        self.done = done
        self.error_type = error_type


class Engine:
    """Runs one worker's code. One instance per worker per process, reused across events.

    ``load`` may be called again with new code (hot reload); an engine must finish calls in
    flight on the old code before the new code takes effect.
    """

    #: MIME type the engine is registered for (informational; the entry point decides).
    mime_type: ClassVar[str] = ""
    #: Per-worker settings this engine reads, beyond the core's (``WorkerSettings``).
    worker_settings: ClassVar[Mapping[str, SettingRule]] = {}

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @classmethod
    def check_host(cls, settings: Settings) -> None:
        """Refuse, with :class:`wm.errors.ConfigurationError`, a host on which this engine
        cannot run as ``settings`` demand, and log what it can do here. Called once when a
        node starts, so a node that could not run the engine safely never takes work."""

    @classmethod
    def host_facts(cls, settings: Settings) -> dict[str, Any]:
        """What an operator should see about this engine on this host (a node's ``/health``
        shows it): for the Python engine, the sandbox layers in force and those missing."""
        return {}

    def validate(self, code: bytes, worker: WorkerSpec) -> None:
        """Refuse bad code with :class:`wm.errors.InvalidCode`; default: load, then close."""
        try:
            self.load(code, worker)
        finally:
            self.close()

    def load(self, code: bytes, worker: WorkerSpec) -> None:
        """Validate and prepare ``code``; raise :class:`wm.errors.InvalidCode` if it is bad."""
        raise NotImplementedError("Engine.load() must be implemented.")

    def process(self, event: CloudEvent, timeout_s: float) -> list[CloudEvent]:
        """Run the code on ``event`` and return the events it produced (maybe none; an
        :class:`Outputs` when the worker answered with an error)."""
        raise NotImplementedError("Engine.process() must be implemented.")

    def process_batch(
        self, events: Sequence[CloudEvent], timeout_s: float
    ) -> list[list[CloudEvent] | Exception]:
        """Run the code on each of ``events`` in one call: for each event, in order, the
        events it produced (as :meth:`process` returns them) or the error it failed with, so
        one failing event fails alone. ``timeout_s`` is the limit of one event; the whole
        call may take ``timeout_s`` times the events. Engines whose code has a batch entry
        point override this; the default calls :meth:`process` once per event."""
        results: list[list[CloudEvent] | Exception] = []
        for event in events:
            try:
                results.append(self.process(event, timeout_s))
            except Exception as exc:  # that event's failure alone
                results.append(exc)
        return results

    def probe(self, timeout_s: float) -> bool | None:
        """Run the health probe of the loaded code (issue 14): True when it passed, False
        when it failed, None when the code has no probe (the default), which the data plane
        remembers for the code's version and stops asking. An exception (the probe raised,
        outlived ``timeout_s`` or crashed its process) counts as a failed probe, its message
        as the reason; engines may raise rather than answer False, to say why."""
        return None

    def close(self) -> None:
        """Release what ``load`` acquired. Safe to call more than once."""

    def processes(self) -> list[int]:
        """Pids of the processes this engine keeps for its worker (a sandbox, a helper): their
        memory counts against the engine cache's budget (``WM_ENGINE_CACHE_MB``)."""
        return []

    def stops_calls(self) -> bool:
        """True when the engine itself stops a call at its time limit (its code runs in a
        process it kills). False (the default): the code runs in this process, and the data
        plane's watchdog ends the process when a call outlives its limit."""
        return False

    def kill(self) -> bool:
        """Kill the processes running the worker's code now, from any thread, without waiting
        for calls in flight (they fail; the next call starts afresh). False when the code runs
        in this process and cannot be killed apart from it. Default: SIGKILL each of
        :meth:`processes` (with its process group when it leads one: a sandbox's children)."""
        pids = self.processes()
        for pid in pids:
            try:
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return bool(pids)


_PAGE = os.sysconf("SC_PAGE_SIZE")
#: This process's ``/proc/self/statm``, kept open (its pid, the descriptor): an engine's
#: load reads it twice, and opening it cost 16 of the 18 µs a read took.
_statm: tuple[int, int] | None = None


def resident_bytes(pid: int | None = None) -> int:
    """Resident memory of a process (default: this one) from ``/proc``; 0 when unknown."""
    try:
        if pid is None:
            return int(os.pread(_own_statm(), 128, 0).split()[1]) * _PAGE
        with open(f"/proc/{pid}/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _own_statm() -> int:
    global _statm
    pid = os.getpid()
    if _statm is None or _statm[0] != pid:  # a forked child reads its own
        _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY))
    return _statm[1]


def child_pids(pid: int) -> list[int]:
    """The child processes of ``pid`` (none once it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as handle:
            return [int(child) for child in handle.read().split()]
    except (OSError, ValueError):
        return []


def tree_resident_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants (a sandbox or helper may run under a
    wrapper such as bubblewrap)."""
    return resident_bytes(pid) + sum(map(tree_resident_bytes, child_pids(pid)))


# -- registry --------------------------------------------------------------------------------

#: Entry-point group engines register their MIME type in.
ENTRY_POINT_GROUP = "wm.engines"


@cache
def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def registered_mime_types() -> list[str]:
    """MIME types with a registered engine, sorted."""
    return sorted(_entry_points())


def engine_class(mime_type: str) -> type[Engine]:
    """The engine class for ``mime_type``, imported on first use."""
    found = _entry_points().get(mime_type)
    if found is None:
        known = registered_mime_types()
        close = difflib.get_close_matches(mime_type, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise EngineNotFound(
            f"no engine is registered for MIME type {mime_type!r}.{hint} "
            f"Registered: {', '.join(known) or '(none)'}"
        )
    try:
        cls = found.load()
    except ImportError as exc:
        raise EngineUnavailable(
            f"the engine for {mime_type!r} cannot be imported ({exc}); install the extra "
            "that provides it (see the engine table in docs/guides/python-api.md)"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise EngineUnavailable(f"entry point {found.value!r} for {mime_type!r} is not an Engine")
    return cls


def check_engines(settings: Settings) -> None:
    """Run every installed engine's host check; one whose optional dependency is missing is
    logged and skipped (its workers fail with the install hint if they reach this node)."""
    for mime_type in registered_mime_types():
        try:
            cls = engine_class(mime_type)
        except EngineUnavailable as exc:
            logger.warning("engine for %s is not installed here: %s", mime_type, exc)
            continue
        cls.check_host(settings)


def engine_facts(settings: Settings) -> dict[str, dict[str, Any]]:
    """Each installed engine's :meth:`Engine.host_facts` that says anything, by MIME type."""
    facts: dict[str, dict[str, Any]] = {}
    for mime_type in registered_mime_types():
        try:
            found = engine_class(mime_type).host_facts(settings)
        except EngineUnavailable:
            continue  # logged once by check_engines; its workers fail with the install hint
        if found:
            facts[mime_type] = found
    return facts
