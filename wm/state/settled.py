"""Messages settled by a pool process that then ended on purpose — its code outlived its time
limit and could not be stopped, or it grew past its worker's ``max_memory_mb``. The node hands
such a message out again as lost with its process; its next run finds the mark here and only
acknowledges it: ``wm:settled:<worker id>:<message>``."""

from __future__ import annotations

from wm.config import Settings
from wm.state.connection import redis_errors, redis_for

_SETTLED = "wm:settled:"
#: How long a mark is kept: far longer than the broker takes to hand the message out again.
TTL_S = 24 * 3600


def mark(settings: Settings, message_key: str) -> None:
    with redis_errors(settings):
        redis_for(settings).set(_SETTLED + message_key, 1, ex=TTL_S)


def marked(settings: Settings, message_key: str) -> bool:
    with redis_errors(settings):
        return bool(redis_for(settings).exists(_SETTLED + message_key))
