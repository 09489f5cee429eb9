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

from redis.client import Pipeline

from wm.config import Settings
from wm.errors import OutputTooLarge
from wm.events import CloudEvent, decode, encode
from wm.state.connection import (
    StatePipeline,
    StateRedis,
    check_wait,
    queue_eval,
    queue_wait,
    redis_errors,
    redis_for,
)
from wm.state.ledger import Settlement
from wm.state.locks import FENCE_CHECK_LUA, WriteFence
from wm.state.unawaited import UNAWAITED

#: ``wm:outcome:{<worker id>}:<event key>``: tagged with the worker's id, like its pending
#: ledger and directory entry, so the record script and the directory's MGET touch one slot.
_OUTCOME = "wm:outcome:"
# K: outcome, the worker's pending index[, its runs], all tagged {<worker id>}.
# ARGV: outputs, ttl s, index member, event key. Ends with ``stored``: false when recorded,
# else the outcome recorded before.
_RECORD_BODY = """
local stored = false
if not redis.call('SET', K[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  stored = redis.call('GET', K[1])
end
redis.call('ZREM', K[2], ARGV[3])
if K[3] then redis.call('HDEL', K[3], ARGV[4]) end
"""
# KEYS: K. Returns nil when recorded, else the outcome recorded before.
_RECORD = "local K = KEYS" + _RECORD_BODY + "return stored\n"
# KEYS: the group lock's record, then K; ARGV[5..8]: the fence's (owner, fence, lease ms,
# '1'). Returns {1, stored}, or the fence check's {0, owner, fence} with nothing written.
_RECORD_FENCED = (
    "local FENCE_KEY, FENCE_ARGS = KEYS[1], {ARGV[5], ARGV[6], ARGV[7], ARGV[8]}"
    + FENCE_CHECK_LUA
    + "local K = {KEYS[2], KEYS[3], KEYS[4]}"
    + _RECORD_BODY
    + "return {1, stored}\n"
)


class Outcomes:
    """Recorded outcomes keyed by worker id and input event key (source + id)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.ttl_s = settings.outcome_ttl_s

    @property
    def redis(self) -> StateRedis:
        return redis_for(self.settings)

    @staticmethod
    def key(worker_id: str, event_key: str) -> str:
        return f"{_OUTCOME}{{{worker_id}}}:{event_key}"

    def get(self, worker_id: str, event_key: str) -> list[CloudEvent] | None:
        """The recorded outputs, or None when this event has no recorded outcome."""
        with redis_errors(self.settings):
            return self.parse(self.redis.get(self.key(worker_id, event_key)))

    @staticmethod
    def parse(raw: bytes | str | None) -> list[CloudEvent] | None:
        return None if raw is None else [decode(item) for item in json.loads(raw)]

    def encoded(self, outputs: list[CloudEvent], texts: list[str] | None = None) -> str:
        """The outcome as recorded; :class:`~wm.errors.OutputTooLarge` over
        ``WM_MAX_OUTPUT_BYTES``, the one cap of every engine (nothing is written then).
        ``texts``: the outputs' :func:`~wm.events.encode`, when the caller needs them too."""
        texts = [encode(e) for e in outputs] if texts is None else texts
        body = json.dumps(texts)  # ASCII: one byte per character
        limit = self.settings.max_output_bytes
        if len(body) > limit:
            raise OutputTooLarge(
                f"the worker returned {len(outputs)} event(s) of {len(body)} bytes as "
                f"recorded, over WM_MAX_OUTPUT_BYTES ({limit}); nothing was published"
            )
        return body

    def record(
        self,
        worker_id: str,
        event_key: str,
        outputs: list[CloudEvent],
        settlement: Settlement,
        also: Callable[[StatePipeline], None] | None = None,
        fence: WriteFence | None = None,
        body: str | None = None,
        unread: int | None = None,
    ) -> tuple[list[CloudEvent], list[Any]]:
        """Record the outcome and settle the delivery in the pending ledger, in one script;
        return the outcome that counts: when two copies of a delivery ran at once, the
        first record wins and both publish it. ``also`` may queue more commands in the same
        round trip; their results come second (on a Redis Cluster, a round trip to each
        node their keys live on, sent together). With ``fence``, the same script checks the
        group lock first and writes nothing, raising :class:`~wm.errors.FenceRejected`, when
        the lease was lost. ``body``: the outputs :meth:`encoded` already.

        ``unread``: the caller needs nothing from the reply, nor from the first ``unread``
        commands ``also`` queues, and nothing it does next assumes they were written (see
        ``wm.state.unawaited``), so where they are all there is to send (no fence, no WAIT,
        nothing more from ``also``, one server) they are sent without waiting for their
        replies, and ``(outputs, [])`` is returned. Should their replies hold a failover's
        error or not come, the delivery is made due at the sweep's next turn (where it is
        still pending, or, with outputs, anyway: their pushes may not have run)."""
        key = self.key(worker_id, event_key)
        body = self.encoded(outputs) if body is None else body
        script, keys, args = self._script(key, body, settlement, fence)
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            queue_eval(pipe, script, keys, *args)
            waited = queue_wait(pipe, self.settings, key)  # right behind the record
            if also is not None:
                also(pipe)
            what = f"the outcome of event {event_key} of worker {worker_id}"
            if fence is None and not waited and self._sent(pipe, what, settlement, unread):
                return outputs, []
            reply, *more = pipe.execute()
        acknowledged = more.pop(0) if waited else None
        counts = self.recorded(reply, outputs, fence)
        if waited:
            check_wait(self.settings, acknowledged, "an outcome")
        return counts, more

    @staticmethod
    def _sent(pipe: StatePipeline, what: str, settlement: Settlement, more: int | None) -> bool:
        """Send the commands queued in ``pipe`` (``what``: the record) without waiting for
        their replies (:data:`~wm.state.unawaited.UNAWAITED`) where they are the record and
        ``more`` on a single server (a cluster's pipeline may go to several); whether they
        were sent."""
        if more is None or len(pipe) != 1 + more or not isinstance(pipe, Pipeline):
            return False
        record, *pushes = [args for args, _ in pipe.command_stack]  # as queued
        if more:
            what += f" and its {more} output(s)' push"
        UNAWAITED.send(pipe, record, what, settlement.due_now(pending_only=not more), pushes)
        return True

    def queue_record(
        self,
        pipe: StatePipeline,
        worker_id: str,
        event_key: str,
        body: str,
        settlement: Settlement,
        fence: WriteFence | None = None,
    ) -> None:
        """:meth:`record`'s script for one of a batch's deliveries (``body``: its
        :meth:`encoded` outputs), queued in ``pipe``; :meth:`recorded` reads its reply."""
        script, keys, args = self._script(self.key(worker_id, event_key), body, settlement, fence)
        queue_eval(pipe, script, keys, *args)

    def _script(
        self, key: str, body: str, settlement: Settlement, fence: WriteFence | None
    ) -> tuple[str, list[str], list[Any]]:
        """The record's script, keys and arguments for the outcome ``key`` (fenced or not)."""
        keys = [key, settlement.index] + ([settlement.runs] if settlement.runs else [])
        args: list[Any] = [body, self.ttl_s, settlement.member, settlement.key]
        if fence is None:
            return _RECORD, keys, args
        return _RECORD_FENCED, [fence.key, *keys], [*args, *fence.args]

    def recorded(
        self, reply: Any, outputs: list[CloudEvent], fence: WriteFence | None = None
    ) -> list[CloudEvent]:
        """The outcome that counts, from the reply of the record's script (queued by
        :meth:`record` or :meth:`queue_record`; ``FenceRejected`` when the lease was lost:
        nothing was written)."""
        if fence is not None:
            if int(reply[0]) == 0:
                raise fence.refused(reply[1], reply[2])
            reply = reply[1]
        return outputs if reply is None else self.parse(reply) or []
