"""A publish batch on WorkManager's Redis transport (``wm.dataplane.transport``), the one
``Bus.publish_many`` sends through (``wm.dataplane.batches``)."""

from __future__ import annotations

import json
import uuid
from base64 import b64encode
from typing import Any

from kombu.exceptions import BatchPublishError
from kombu.transport import redis as kombu_redis

from wm.dataplane.queues import EXCHANGE
from wm.dataplane.readyscripts import PUT, PUT_MESSAGES


class ReadyBatch(kombu_redis.PublishBatch):
    """kombu's publish batch (``Producer.batch``: one pipeline, one round trip), whose
    messages to a worker queue are pushed by one script per queue and batch (``PUT``),
    not one script each: Redis runs, and redis-py encodes and parses, a command per queue
    instead of one per message (a third of a batched publish's time). Within a queue the
    messages keep their order."""

    def __init__(self, channel: kombu_redis.Channel, max_size: int) -> None:
        # ``channel``: ``wm.dataplane.transport.Channel``, which imports this module
        super().__init__(channel, max_size)
        self._puts: dict[tuple[str, str, str], list[str]] = {}
        # put_task's delivery tags: unique as kombu's (a uuid4 each) at a uuid4 a batch
        self._tags = f"{uuid.uuid4()}."
        self._tagged = 0

    def put(self, keys: list[str], queue: str, message: str) -> None:
        """Hold ``message`` for the list ``keys[0]`` of ``queue`` (``keys[1]``: the ready
        list) until the batch is flushed."""
        self._puts.setdefault((keys[0], keys[1], queue), []).append(message)
        self._buffered += 1

    def takes(self, queue: str) -> bool:
        """Whether :meth:`put_task` may hold messages for ``queue`` (a worker queue that
        goes through the ready list)."""
        return bool(self.channel._ready_for(queue))

    def put_task(
        self, queue: str, body: Any, headers: dict[str, Any], properties: dict[str, Any]
    ) -> None:
        """Hold a Celery task message (JSON, persistent, priority 0) for ``queue``, a declared
        queue that :meth:`takes`: the message ``Producer.publish`` would hold, routed to it by
        the direct exchange, built without kombu's per-message layers (its serializer
        registry, the exchange's routing table, the delivery-info updates), most of a batched
        publish's time. Its parts are plain JSON (strings, numbers, lists, dicts, None), which
        ``json.dumps`` writes as kombu's encoder would."""
        channel = self.channel
        message = {
            "body": b64encode(json.dumps(body).encode("utf-8")).decode("ascii"),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": {
                **properties,
                "delivery_mode": 2,
                "delivery_info": {"exchange": EXCHANGE.name, "routing_key": queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": f"{self._tags}{self._tagged}",
            },
        }
        self._tagged += 1
        keys = [channel._q_for_pri(queue, channel._get_message_priority(message, False))]
        self.put([*keys, channel.ready_key], queue, json.dumps(message))
        self._flush_if_full()

    def publish(self, message: Any, **kwargs: Any) -> Any:
        result = super().publish(message, **kwargs)
        self._flush_if_full()
        return result

    def _flush_if_full(self) -> None:
        if self._buffered >= self.max_size:
            self.flush()

    def flush(self) -> None:
        """Add the held messages to the pipeline and execute it (a pipeline sends EVAL, not
        EVALSHA, which a restarted Redis would refuse); with the channel's ``wait_replicas``,
        WAIT last, and the batch fails unless enough replicas acknowledged it."""
        self._check_usable()
        for (key, ready, queue), messages in self._puts.items():
            for start in range(0, len(messages), PUT_MESSAGES):
                held = messages[start : start + PUT_MESSAGES]
                self.pipeline.eval(PUT, 2, key, ready, queue, *held)
        self._puts.clear()
        channel = self.channel
        if not (channel.wait_replicas and self._buffered):
            super().flush()
            return
        channel.queue_wait(self.pipeline)
        try:  # kombu's flush, which drops the replies
            *_, acknowledged = self.pipeline.execute()
        except BaseException as exc:
            self._failed = exc
            self._buffered = 0
            self.pipeline.reset()
            if isinstance(exc, Exception):
                raise BatchPublishError(
                    "Redis publish batch failed; delivery is uncertain"
                ) from exc
            raise
        self._buffered = 0
        channel.check_wait(acknowledged, "a batch of published messages")

    def discard(self) -> None:
        self._puts.clear()
        super().discard()
