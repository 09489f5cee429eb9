"""A publish batch on WorkManager's Redis transport (``wm.dataplane.transport``), the one
``Bus.publish_many`` sends through (``wm.dataplane.batches``)."""

from __future__ import annotations

import json
import os
import uuid
from base64 import b64encode
from json.encoder import encode_basestring_ascii
from typing import Any

from celery import Celery
from kombu.exceptions import BatchPublishError
from kombu.transport import redis as kombu_redis

from wm.dataplane.queues import DELIVER_TASK, EXCHANGE
from wm.dataplane.readyscripts import PUT, PUT_MESSAGES
from wm.dataplane.takenfacts import KEY_HEADER


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

    def put(self, keys: list[str], queue: str, message: str) -> None:
        """Hold ``message`` for the list ``keys[0]`` of ``queue`` (``keys[1]``: the ready
        list) until the batch is flushed."""
        self._puts.setdefault((keys[0], keys[1], queue), []).append(message)
        self._buffered += 1

    def takes(self, queue: str) -> bool:
        """Whether :meth:`put_text` may hold messages for ``queue`` (a worker queue that
        goes through the ready list)."""
        return bool(self.channel._ready_for(queue))

    def put_text(self, queue: str, text: str) -> None:
        """Hold a message for ``queue``, a declared queue that :meth:`takes`, as the text
        the transport stores (:class:`TaskTexts`), priority 0."""
        self.put([self.channel._q_for_pri(queue, 0), self.channel.ready_key], queue, text)
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


class TaskTexts:
    """The text of a Celery ``wm.deliver`` task message as WorkManager's Redis transport
    stores it, the text ``Producer.publish`` would push (JSON, persistent, priority 0, the
    body base64), for :meth:`ReadyBatch.put_text`. Celery builds one message
    (``as_task_v2``) and kombu's parts are added around it, with placeholders where messages
    differ; each message's own values, encoded as ``json.dumps`` encodes them, go in. That
    is a fifth of the time of building the message and encoding it whole (17 → 3.5 µs),
    most of ``publish_many``'s per-event time.

    Task ids are UUIDs whose last four hex digits count the messages under random
    leading ones, drawn again every 65,536 messages (``str(uuid4())`` is 2.5 µs)."""

    def __init__(self, app: Celery, origin: str) -> None:
        marks = {name: f"@wm-{name}@" for name in _FILLED}
        labels = {name: marks[name] for name in ("shadow", "argsrepr", "kwargsrepr")}
        message = app.amqp.as_task_v2(marks["id"], DELIVER_TASK, [], {}, origin=origin, **labels)
        message.headers[KEY_HEADER] = marks["key"]
        stored = {
            "body": marks["body"],
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": message.headers,
            "properties": {
                **message.properties,
                "delivery_mode": 2,
                "delivery_info": {"exchange": EXCHANGE.name, "routing_key": marks["queue"]},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": marks["tag"],
            },
        }
        text = json.dumps(stored).replace("{", "{{").replace("}", "}}")
        for name, mark in marks.items():
            text = text.replace(json.dumps(mark), f"{{{name}}}")
        self._format = text.format
        _, _, embed = message.body
        self._body_end = f", {json.dumps(embed)}]"
        self._ids, self._counted = "", _IDS_PER_PREFIX
        self._tags, self._tagged = f"{os.urandom(16).hex()}.", 0

    def task_id(self) -> str:
        """A new task id."""
        if self._counted == _IDS_PER_PREFIX:
            self._ids, self._counted = str(uuid.uuid4())[:-4], 0
        self._counted += 1
        return f"{self._ids}{self._counted - 1:04x}"

    def text(
        self,
        queue: str,
        task_id: str,
        args: list[Any],
        kwargs: dict[str, Any],
        labels: dict[str, str],
        key: str | None = None,
    ) -> str:
        """The stored text of the task message ``task_id`` with ``args`` and ``kwargs`` to
        ``queue``, labelled with ``labels`` (``wm.dataplane.queues.delivery_labels``), its
        event's ``key`` in its :data:`~wm.dataplane.takenfacts.KEY_HEADER` header."""
        body = f"[{json.dumps(args)}, {json.dumps(kwargs) if kwargs else '{}'}{self._body_end}"
        self._tagged += 1
        return self._format(
            body=f'"{b64encode(body.encode("utf-8")).decode("ascii")}"',
            id=_quoted(task_id),
            queue=_quoted(queue),
            tag=f'"{self._tags}{self._tagged}"',
            shadow=_quoted(labels["shadow"]),
            argsrepr=_quoted(labels["argsrepr"]),
            kwargsrepr=_quoted(labels["kwargsrepr"]),
            key="null" if key is None else _quoted(key),
        )


#: The values :class:`TaskTexts` puts into its template.
_FILLED = ("body", "id", "queue", "tag", "shadow", "argsrepr", "kwargsrepr", "key")
#: Task ids :meth:`TaskTexts.task_id` counts under one random prefix.
_IDS_PER_PREFIX = 0x10000
#: A string as ``json.dumps`` writes it (its own fast path).
_quoted = encode_basestring_ascii
