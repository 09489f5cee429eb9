"""What a node's pool processes tell its main process about their health: the workers whose
engine could not be loaded there.

A prefork node's deliveries run in child processes that come and go; its health is answered
by the main process (``wm.ops.health``). A child that fails to load a worker's engine (code
this host cannot run, a missing runtime) records it in ``wm:node:{<node name>}:engine-failures``,
a hash of worker id → error, which the main process reads. The hash expires
:data:`FAILURE_TTL_S` after the last failure recorded, so a node whose failures stopped
becomes healthy again (the worker itself is ``failed`` until an operator starts it again).
"""

from __future__ import annotations

from wm.config import Settings
from wm.state.connection import redis_errors, redis_for, text

#: Seconds a node keeps reporting engine load failures after the last one.
FAILURE_TTL_S = 3600


def _key(node: str) -> str:
    return f"wm:node:{{{node}}}:engine-failures"


class EngineFailures:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def record(self, node: str, worker_id: str, error: str) -> None:
        with redis_errors(self.settings):
            pipe = redis_for(self.settings).pipeline(transaction=False)
            pipe.hset(_key(node), worker_id, error)
            pipe.expire(_key(node), FAILURE_TTL_S)
            pipe.execute()

    def of(self, node: str) -> dict[str, str]:
        """Worker id → the error of its last failed load on ``node``."""
        with redis_errors(self.settings):
            raw = redis_for(self.settings).hgetall(_key(node))
        return {text(worker): text(error) for worker, error in raw.items()}
