"""What a log record is about: the delivery in progress, as fields every record carries.

The delivery task binds its worker, event, correlation id, topic, attempt and tenant here; a logging
filter (``wm.ops.logs``) copies them onto each record handled while they are bound, so the
lines of Celery, of the libraries and of the engines about a delivery carry them too, not
only WorkManager's own. The data plane sets them and never configures logging.

On a node a scope spans the whole task (Celery's ``task_prerun`` to ``task_postrun``,
connected in ``wm.celeryapp``), so Celery's own line about the task's end (its retry, its
failure) carries the fields; elsewhere (a worker in a thread of a test) the delivery opens
its own scope.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar, Token
from types import MappingProxyType

from wm.text import storable

#: The fields a delivery binds, as record attributes: the worker's name (its id when it has
#: none) and id, the event's id and ``correlationid``, its trace id (of its ``traceparent``,
#: or of the delivery's span when tracing), the worker's topic, the attempt (1…), and the
#: worker's tenant outside the default one (whose lines are as before tenants).
FIELDS = (
    "worker",
    "worker_id",
    "event_id",
    "correlation_id",
    "trace_id",
    "topic",
    "attempt",
    "tenant",
)

#: Longest field value a record carries (an event id may be anything a publisher chose).
FIELD_CHARS = 256

#: The event extension that carries the correlation id (the DevKit copies it to outputs).
CORRELATION_EXTENSION = "correlationid"

_fields: ContextVar[dict[str, object] | None] = ContextVar("wm_log_fields", default=None)
_NONE: Mapping[str, object] = MappingProxyType({})
#: Open task scopes by Celery task id (a scope ends in the thread that began it).
_tasks: dict[str, Token[dict[str, object] | None]] = {}


def current() -> Mapping[str, object]:
    """The fields bound now (empty outside a delivery)."""
    return _fields.get() or _NONE


def bind(**fields: object) -> None:
    """Add ``fields`` (those not None) to the open scope; outside one, nothing happens: a
    field bound with nothing to end it would stick to every later line."""
    bound = _fields.get()
    if bound is not None:
        bound.update(
            (name, storable(value, FIELD_CHARS) if isinstance(value, str) else value)
            for name, value in fields.items()
            if value is not None
        )


@contextlib.contextmanager
def scope(**fields: object) -> Iterator[None]:
    """Bind ``fields`` for the block: in the task's scope if one is open (its later lines keep
    them), else in a scope of the block's own."""
    if _fields.get() is not None:
        bind(**fields)
        yield
        return
    token = _fields.set({})
    try:
        bind(**fields)
        yield
    finally:
        _fields.reset(token)


def begin_task(task_id: str) -> None:
    """A task starts (``task_prerun``): a fresh scope until :func:`end_task`."""
    _tasks[task_id] = _fields.set({})


def end_task(task_id: str) -> None:
    """The task ended (``task_postrun``): its fields are gone."""
    token = _tasks.pop(task_id, None)
    if token is not None:
        _fields.reset(token)
