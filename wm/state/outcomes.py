"""Outcome records: no side effect without a recorded outcome (seed 002).

The outcome of a delivery (the output events, with their deterministic ids) is recorded in
Redis *before* any output is published. A redelivered event whose outcome is recorded
republishes the recorded outputs instead of running the code again (``wm.dataplane.outputs`` makes
that republish reach each plain subscription once).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import redis
from redis.client import Pipeline

from wm.config import Settings
from wm.events import CloudEvent, decode, encode
from wm.state.connection import redis_errors, redis_for

_OUTCOME = "wm:outcome:"


class Outcomes:
    """Recorded outcomes keyed by worker id and input event key (source + id)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.ttl_s = settings.outcome_ttl_s

    @property
    def redis(self) -> redis.Redis:
        return redis_for(self.settings)

    @staticmethod
    def key(worker_id: str, event_key: str) -> str:
        return f"{_OUTCOME}{{{worker_id}}}:{event_key}"

    def get(self, worker_id: str, event_key: str) -> list[CloudEvent] | None:
        """The recorded outputs, or None when this event has no recorded outcome."""
        with redis_errors(self.settings):
            return self.parse(self.redis.get(self.key(worker_id, event_key)))

    def lookup(self, worker_id: str, event_key: str) -> Callable[[Pipeline], None]:
        """Queues :meth:`get` in a pipeline; :meth:`parse` reads its result."""
        key = self.key(worker_id, event_key)

        def queue(pipe: Pipeline) -> None:
            pipe.get(key)

        return queue

    @staticmethod
    def parse(raw: bytes | str | None) -> list[CloudEvent] | None:
        return None if raw is None else [decode(item) for item in json.loads(raw)]

    def record(
        self,
        worker_id: str,
        event_key: str,
        outputs: list[CloudEvent],
        also: Callable[[Pipeline], None] | None = None,
    ) -> tuple[list[CloudEvent], list[Any]]:
        """Record the outcome and return the one that counts: when two copies of a delivery
        ran at once, the first record wins and both publish it. ``also`` may queue more
        commands in the same round trip; their results come second."""
        key = self.key(worker_id, event_key)
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=True)
            pipe.set(key, json.dumps([encode(e) for e in outputs]), ex=self.ttl_s, nx=True)
            pipe.get(key)
            if also is not None:
                also(pipe)
            created, stored, *more = pipe.execute()
        return (outputs if created else self.parse(stored) or []), more
