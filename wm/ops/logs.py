"""How WorkManager's processes log: the ``wm`` command and the nodes.

``WM_LOG_LEVEL`` sets the ``wm`` command's own loggers; other libraries (Celery, kombu,
Alembic) speak only from WARNING, unless the level is DEBUG. A node logs at Celery's
``--loglevel``.

``WM_LOG_FORMAT`` is ``text`` (lines for people; a node keeps Celery's) or ``json``: one
JSON object per line (python-json-logger), for a log collector. Every record handled while
a delivery runs carries that delivery's fields (``wm.dataplane.logcontext``), whichever
library logged it: JSON fields, or ``[worker=… event=… correlation=… attempt=…]`` after the
message in text.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING

from wm.dataplane import logcontext
from wm.errors import ConfigurationError
from wm.text import storable

if TYPE_CHECKING:
    from wm.config import Settings

#: Values of WM_LOG_LEVEL; the format of a text line; the loggers WM_LOG_LEVEL sets (the
#: libraries' speak from WARNING).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
OWN_LOGGERS = ("wm", "engines")
#: A JSON line's fields besides the delivery's, the task's and an exception's, renamed as
#: collectors expect them; ``time`` is RFC 3339 in UTC.
JSON_FIELDS = ("levelname", "name", "processName", "message")
JSON_NAMES = {"levelname": "level", "name": "logger", "processName": "process"}
TIME_FIELD = "time"
#: Longest message a log line keeps (characters); the rest is cut, and says so.
MAX_LOG_MESSAGE_CHARS = 16384
#: Delivery fields shown in a text line, with their labels there.
TEXT_FIELDS = {
    "tenant": "tenant",
    "worker": "worker",
    "event_id": "event",
    "correlation_id": "correlation",
    "trace_id": "trace",
    "attempt": "attempt",
}


def level_of(settings: Settings) -> int:
    """WM_LOG_LEVEL as a logging level; a value that names none is refused."""
    level = settings.log_level.upper()
    if level not in LOG_LEVELS:
        raise ConfigurationError(
            f"WM_LOG_LEVEL={settings.log_level!r} is malformed: expected one of "
            f"{', '.join(LOG_LEVELS)}"
        )
    own: int = logging.getLevelName(level)
    return own


def configure(settings: Settings, stream: IO[str] | None = None) -> None:
    """Log to ``stream`` (standard error): WorkManager's loggers at WM_LOG_LEVEL, others from
    WARNING unless that level is DEBUG, as WM_LOG_FORMAT says."""
    own = level_of(settings)
    others = own if own == logging.DEBUG else max(own, logging.WARNING)
    handler = logging.StreamHandler(stream or sys.stderr)
    plain = logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(json_formatter() if settings.log_format == "json" else TextFields(plain))
    handler.addFilter(DeliveryFields())
    logging.basicConfig(level=others, handlers=[handler], force=True)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(own)


def install_on_node(settings: Settings, loggers: Iterable[logging.Logger | None]) -> None:
    """Give the handlers Celery set up on a node (``after_setup_logger`` and
    ``after_setup_task_logger``, connected in ``wm.celeryapp``) the delivery's fields, and
    with WM_LOG_FORMAT=json the JSON formatter instead of Celery's text. Idempotent."""
    for logger in loggers:
        for handler in logger.handlers if logger is not None else ():
            _install(settings, handler)


def _install(settings: Settings, handler: logging.Handler) -> None:
    if not any(isinstance(f, DeliveryFields) for f in handler.filters):
        handler.addFilter(DeliveryFields())
    current = handler.formatter
    if getattr(current, "WORKMANAGER", False):  # ours already (TextFields, JsonLines)
        return
    if settings.log_format == "json":
        handler.addFilter(TaskFields())
        handler.setFormatter(json_formatter())
    else:
        handler.setFormatter(TextFields(current or logging.Formatter()))


class DeliveryFields(logging.Filter):
    """Copies the fields of the delivery in progress onto each record (a field the call
    gave in ``extra`` wins). A filter of the handler, so records of every logger get them."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in logcontext.current().items():
            if not hasattr(record, name):
                setattr(record, name, value)
        _make_storable(record)
        return True


def _make_storable(record: logging.LogRecord) -> None:
    """The record's message as a line every log stream accepts, bounded (``wm.text``): an
    error text may hold lone surrogates, NUL or megabytes."""
    try:
        message = record.getMessage()
    except (TypeError, ValueError):  # logging reports a malformed call itself, in emit
        return
    line = storable(message, MAX_LOG_MESSAGE_CHARS)
    if line != message:
        record.msg, record.args = line, None


class TaskFields(logging.Filter):
    """The Celery task's id and name, as Celery's text lines of a task show them."""

    def filter(self, record: logging.LogRecord) -> bool:
        from celery import current_task

        if current_task and current_task.request:
            record.__dict__.setdefault("task_id", current_task.request.id)
            record.__dict__.setdefault("task_name", current_task.name)
        return True


class TextFields(logging.Formatter):
    """Another formatter's text (Celery's, colours and all), with the delivery's fields
    after the message's first line, so a traceback below it stays whole."""

    WORKMANAGER = True

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        text = self.inner.format(record)
        shown = [
            f"{label}={getattr(record, name)}"
            for name, label in TEXT_FIELDS.items()
            if getattr(record, name, None) is not None
        ]
        if not shown:
            return text
        head, newline, rest = text.partition("\n")
        return f"{head} [{' '.join(shown)}]{newline}{rest}"


def json_formatter() -> logging.Formatter:
    """One JSON object per line: time, level, logger, process, message, then the record's
    other fields (the delivery's, ``exc_info`` with the traceback)."""
    from wm.ops.jsonlines import JsonLines  # python-json-logger: only for WM_LOG_FORMAT=json

    return JsonLines(list(JSON_FIELDS), rename_fields=JSON_NAMES, timestamp=TIME_FIELD)
