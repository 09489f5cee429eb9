"""Names on the broker: the exchange, queue naming and task names. Definitions only."""

from __future__ import annotations

from typing import Any

from kombu.entity import Exchange, Queue

from wm.config import Settings
from wm.errors import InvalidArgument
from wm.names import DEFAULT_TENANT

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


def subscription_queue(name: str, settings: Settings | None = None) -> Queue:
    """The durable queue of one subscription, as ``settings`` declare it
    (:func:`queue_arguments`; without them, as a passive declaration or a classic queue)."""
    arguments = queue_arguments(settings, name) if settings is not None else None
    return Queue(name, EXCHANGE, routing_key=name, durable=True, queue_arguments=arguments)


def queue_arguments(settings: Settings, name: str) -> dict[str, Any]:
    """What a queue is declared with on RabbitMQ (WM_AMQP_QUEUE_TYPE): nothing for a
    classic one. A quorum queue gives a message it delivered WM_AMQP_DELIVERY_LIMIT times to
    :data:`DEFAULT_QUEUE` (at least once: RabbitMQ keeps it until that queue has it), where
    a node dead-letters it: RabbitMQ 4 would drop it after 20 deliveries otherwise.
    :data:`DEFAULT_QUEUE` itself has no limit."""
    if settings.amqp_queue_type != "quorum" or not settings.broker_url.startswith(
        ("amqp", "pyamqp")
    ):
        return {}
    if name == DEFAULT_QUEUE:
        return {"x-queue-type": "quorum", "x-delivery-limit": 2**31 - 1}
    return {
        "x-queue-type": "quorum",
        "x-delivery-limit": settings.amqp_delivery_limit,
        "x-dead-letter-exchange": EXCHANGE.name,
        "x-dead-letter-routing-key": DEFAULT_QUEUE,
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",  # what at-least-once needs; no length is set
    }


def over_delivery_limit(headers: dict[str, Any] | None) -> str | None:
    """The queue a message came from when RabbitMQ dead-lettered it for its delivery limit
    (:func:`queue_arguments`: its ``x-death`` header says so), else None."""
    for death in (headers or {}).get("x-death") or ():
        if isinstance(death, dict) and death.get("reason") == "delivery_limit":
            return str(death.get("queue") or "unknown")
    return None


def worker_queue_name(topic: str, worker_id: str) -> str:
    return f"{topic}::{worker_id}"


def is_worker_queue(name: str) -> bool:
    """True for ``<topic>::<worker id>`` and, in a tenant other than the default,
    ``<tenant>::<topic>::<worker id>`` (``wm.names.route_topic``; a topic never holds
    ``::``). A plain subscription's queue, ``[<tenant>::]<topic>::sub::<name>``, has ``sub``
    where a tenant's queue has its topic: a tenant's worker on the topic ``sub`` counts as
    a plain queue here (its messages skip the ready list, on both sides alike)."""
    parts = name.split("::")
    if len(parts[-1]) != 36:
        return False
    return len(parts) == 2 or (len(parts) == 3 and parts[1] != "sub")


def queue_tenant(name: str) -> str | None:
    """The tenant whose worker (or shared group) a worker queue belongs to, read from its
    name alone (``<tenant>::<topic>::<id>``, the default tenant's ``<topic>::<id>``); None
    for a name that is no worker queue's, whose tenant the name does not say."""
    if not is_worker_queue(name):
        return None
    parts = name.split("::")
    return parts[0] if len(parts) == 3 else DEFAULT_TENANT


def plain_queue_name(topic: str, name: str) -> str:
    return f"{topic}::sub::{name}"


#: Longest queue name in UTF-8 bytes: AMQP's limit. Names (``wm.names``) keep the default
#: tenant's queues within it; a tenant's prefix may take a plain subscription's past it.
MAX_QUEUE_BYTES = 255


def check_queue_name(queue: str) -> str:
    """``queue`` if it fits every broker; else :class:`InvalidArgument`."""
    size = len(queue.encode("utf-8"))
    if size > MAX_QUEUE_BYTES:
        raise InvalidArgument(
            f"queue name {queue[:60]!r}... would be {size} bytes long; the limit is "
            f"{MAX_QUEUE_BYTES} bytes (shorten the topic or the subscription name)"
        )
    return queue


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
