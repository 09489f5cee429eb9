"""``session_key``: the events of one session run on one engine instance while the binding
lives (seed 004's session affinity; ``wm.state.affinity``, ``wm.dataplane.sessions``).

The session is the value the worker's ``session_key`` names in the event (an attribute such
as ``sessionid``, or a path into its data); an event without one runs as any other. Around
the call: an unbound (or expired) session binds to this process, a *miss*; one bound here
runs here, a *hit*; one bound to another live instance has its call run there, a *hit*; one
bound to an instance that is gone (its process or node ended) rebinds here, a *miss*. Each
event of the session renews the binding for ``session_idle_s``, as it arrives and with its
outcome's record.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from wm.dataplane import sessions
from wm.dataplane.delivery import Delivery
from wm.dataplane.observe import notify
from wm.dataplane.pipeline import NOTHING, Feature
from wm.engine import Engine
from wm.errors import IdempotencyKeyMissing
from wm.events import CloudEvent
from wm.idempotency import key_source
from wm.state import affinity
from wm.state.affinity import ELSEWHERE, MISS, Affinity
from wm.state.connection import StatePipeline


def session_of(delivery: Delivery) -> str | None:
    """The delivery's session (None: its worker has no ``session_key``, or the event none)."""
    declared = delivery.worker_settings.session_key
    if declared is None:
        return None
    try:
        return key_source(declared).value(delivery.event)
    except IdempotencyKeyMissing:
        return None


class SessionAffinity(Feature):
    owns = ("session_key", "session_idle_s")

    def __init__(self) -> None:
        #: the instance the delivery of this thread's call runs on (for :meth:`recording`)
        self._ran = threading.local()

    def around_run(self, delivery: Delivery) -> AbstractContextManager[object]:
        """Bound before the engine loads: the process that takes a session's first event
        binds it, and a call that runs elsewhere loads no engine here."""
        session = session_of(delivery)
        return NOTHING if session is None else self._bound(delivery, session)

    @contextmanager
    def _bound(self, delivery: Delivery, session: str) -> Iterator[Engine | None]:
        rt, wid = delivery.rt, delivery.meta.id
        sessions.serve(rt)
        bound = _bind(delivery, session)
        self._ran.instance = bound
        if bound == rt.node:
            yield None
            return
        elsewhere = sessions.ElsewhereEngine(
            rt,
            wid,
            delivery.version,
            bound,
            _rebinding(delivery, session, self._ran),
            _here(delivery),
        )
        try:
            yield elsewhere
        finally:
            if elsewhere.answered:
                notify("session_hit", delivery.meta)

    def recording(self, delivery: Delivery, pipe: StatePipeline) -> None:
        session = session_of(delivery)
        instance = getattr(self._ran, "instance", None)
        if session is not None and instance is not None:
            idle_s = delivery.worker_settings.session_idle_s
            affinity.queue_renewal(pipe, delivery.meta.id, session, instance, idle_s)

    def around_call(self, delivery: Delivery, engine: Engine) -> AbstractContextManager[object]:
        """A call here runs after (or before) those handed to this process, never with them."""
        if isinstance(engine, sessions.ElsewhereEngine) or session_of(delivery) is None:
            return NOTHING
        return sessions.calling(delivery.meta.id)


def _bind(delivery: Delivery, session: str) -> str:
    """The instance the session is bound to now; bound here on a miss (counted: a hit
    elsewhere is counted once that instance answered)."""
    rt, wid = delivery.rt, delivery.meta.id
    idle_s, state = _lives_s(delivery), Affinity(rt.settings)
    verdict, bound = state.claim(wid, session, rt.node, idle_s)
    if verdict == ELSEWHERE and not state.alive(bound):
        bound = state.take_over(wid, session, bound, rt.node, idle_s)
        verdict = MISS if bound == rt.node else ELSEWHERE
    if verdict != ELSEWHERE:
        notify("session_miss" if verdict == MISS else "session_hit", delivery.meta)
    return bound


def _lives_s(delivery: Delivery) -> float:
    """How long a binding lives as a call of its session begins: through the call (its time
    limit), then ``session_idle_s`` (renewed with the outcome's record)."""
    return delivery.worker_settings.session_idle_s + delivery.timeout_s


def _rebinding(delivery: Delivery, session: str, ran: threading.local) -> Callable[[str], str]:
    """Moves the session's binding from an instance that went away: to this process unless
    another one took it over first. Returns the instance bound now."""

    def rebind(gone: str) -> str:
        rt, idle_s = delivery.rt, _lives_s(delivery)
        now = Affinity(rt.settings).take_over(delivery.meta.id, session, gone, rt.node, idle_s)
        ran.instance = now
        return now

    return rebind


def _here(delivery: Delivery) -> Callable[[CloudEvent, float], list[CloudEvent]]:
    """The call on this process's engine, once the session rebound here (a miss)."""

    def call(event: CloudEvent, timeout_s: float) -> list[CloudEvent]:
        notify("session_miss", delivery.meta)
        engine, temporary = delivery.load_engine()
        try:
            # watched as the delivery's own call would be (the engine in its place, which
            # hands calls elsewhere, needs no watch, so the pipeline set none)
            with sessions.calling(delivery.meta.id), delivery.watched(engine, time.monotonic()):
                return engine.process(event, timeout_s)
        finally:
            if temporary:
                engine.close()

    return call
