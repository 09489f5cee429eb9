"""Names on the broker: the exchange, queue naming and task names. Definitions only."""

from __future__ import annotations

from kombu.entity import Exchange, Queue

#: Direct exchange every subscription queue is bound to (routing key = queue name).
EXCHANGE = Exchange("wm", type="direct", durable=True)
#: Queue of WorkManager's own tasks (dead-letter replay, maintenance).
DEFAULT_QUEUE = "wm.default"
DELIVER_TASK = "wm.deliver"
#: Redis broker: the list of worker queues holding messages that nodes wait on
#: (``wm.dataplane.transport``, WM_READY_LIST); its hash of queues listed is ``<key>.armed``.
READY_LIST = "wm.ready"
#: Content type of plain-subscription messages.
CLOUDEVENT_CONTENT_TYPE = "application/cloudevents+json"


def subscription_queue(name: str) -> Queue:
    """The durable queue of one subscription."""
    return Queue(name, EXCHANGE, routing_key=name, durable=True)


def worker_queue_name(topic: str, worker_id: str) -> str:
    return f"{topic}::{worker_id}"


def is_worker_queue(name: str) -> bool:
    """True for ``<topic>::<worker id>`` (a topic never holds ``::``; a plain subscription's
    queue has two)."""
    _, sep, tail = name.partition("::")
    return bool(sep) and len(tail) == 36 and "::" not in tail


def plain_queue_name(topic: str, name: str) -> str:
    return f"{topic}::sub::{name}"


def delivery_labels(
    route_topic: str,
    worker: str,
    event_id: str,
    event_type: str,
    attempt: int,
    payload: str | None = None,
) -> dict[str, str]:
    """How a delivery shows in Flower and Celery's logs: the task's ``shadow`` name
    (``deliver <topic> → <worker>``) and its arguments' repr — the event's id and type and
    the attempt, and the event itself only when ``payload`` is given (WM_FLOWER_SHOW_DATA)."""
    args = f"event {event_id} ({event_type})" if payload is None else payload
    return {
        "shadow": f"deliver {route_topic} → {worker}",
        "argsrepr": repr((args,)),
        "kwargsrepr": f"{{'attempt': {attempt}}}",
    }
