"""The pending-ledger sweep: send again what the broker provably lost, and nothing else.

A delivery stays in the ledger (``wm.state.ledger``) from just before it is sent until its
outcome is recorded or it is parked (a send the broker refused leaves nothing there).
Pending long is not lost: a backlog, or a group waiting for its lock, keeps deliveries
pending for minutes while their messages wait in the queue, and re-sending those only
multiplies the backlog. A delivery is lost when its message is
neither in its queue nor held unacknowledged by a node. So per worker the sweep compares
counts first (pending against queued + held: the usual answer is "nothing lost") and only
when the ledger holds more than the broker does it look for the missing event keys,
re-sending at most that many, each once per WM_REDELIVER_AFTER_S.

Only kombu's Redis transport loses messages this way (a node killed between popping a
message and recording it as unacknowledged). An AMQP broker holds every message until it
is acknowledged or its consumer's connection closes, so there the sweep sends nothing.
"""

from __future__ import annotations

import base64
import json
import logging
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from wm.config import Settings
from wm.dataplane.app import broker_errors, redis_broker
from wm.dataplane.bus import Bus, Route
from wm.events import payload_key
from wm.state.ledger import Ledger

logger = logging.getLogger(__name__)


def sweep(settings: Settings, bus: Bus, running: Mapping[str, str]) -> int:
    """Re-send the lost deliveries of running workers (queue → worker id); returns how many."""
    if not redis_broker(settings.broker_url):
        return 0
    ledger = Ledger(settings)
    counts = ledger.pending_of(list(running.values()))
    pending = {queue: counts[w] for queue, w in running.items() if counts[w]}
    if not pending:
        return 0
    sent = 0
    with broker_errors(settings), bus.app.connection_for_write() as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as client:
            held = _held(client, channel)
            for queue, count in pending.items():
                if count > _queued(client, channel, queue) + len(held[queue]):
                    present = held[queue] | _queued_keys(client, channel, queue)
                    sent += _resend(settings, bus, ledger, queue, running[queue], present)
    if sent:
        logger.warning("sent %d lost delivery(ies) again", sent)
    return sent


def _resend(
    settings: Settings, bus: Bus, ledger: Ledger, queue: str, worker_id: str, present: set[str]
) -> int:
    lost = [
        p for p in ledger.overdue(worker_id, settings.redeliver_after_s) if p.key not in present
    ]
    for pending in lost:
        bus.send(pending.payload, [Route(queue, worker_id)], key=pending.key)
    ledger.restart_clock(worker_id, lost)
    return len(lost)


def _queued(client: Any, channel: Any, queue: str) -> int:
    return sum(int(client.llen(key)) for key in _lists(channel, queue))


def _lists(channel: Any, queue: str) -> list[str]:
    return [channel._q_for_pri(queue, pri) for pri in channel.priority_steps]


def _queued_keys(client: Any, channel: Any, queue: str) -> set[str]:
    raw = [item for key in _lists(channel, queue) for item in client.lrange(key, 0, -1)]
    return {key for key in map(_message_key, raw) if key}


def _held(client: Any, channel: Any) -> defaultdict[str, set[str]]:
    """Event keys of unacknowledged messages, by queue (kombu keeps them in one hash)."""
    held: defaultdict[str, set[str]] = defaultdict(set)
    for entry in client.hvals(channel.unacked_key):
        try:
            message, _exchange, routing_key = json.loads(entry)
        except (ValueError, TypeError):
            continue
        key = _message_key(message)
        if key:
            held[routing_key].add(key)
    return held


def _message_key(raw: bytes | str | Mapping[str, Any]) -> str | None:
    """The event key of a ``wm.deliver`` kombu message, or None for anything else."""
    try:
        message = json.loads(raw) if isinstance(raw, bytes | str) else raw
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return payload_key(args[1])
    except (ValueError, TypeError, KeyError, IndexError):
        return None
