"""The first trip's facts, read by the script that takes the message.

A delivery's first round trip reads the worker's facts, the event's recorded outcome and the
features' keys (``wm.dataplane.tasks``). On a busy node that trip, a pool process's request
and its wait, cost 15–20 % of the rate (``docs/benchmarks.md``). Where the broker is a
database of the state store's own Redis server, the node's take script (the ready list's
``TAKE`` and ``TAKE_NEXT``) reads the same keys as it takes the message, and the node hands
them to the pool process in the message's ``wmfacts`` header: the delivery then sends its
record as its first request.

What the script reads: for a worker queue's message (``<topic>::<id>``) whose ``wmkey``
header (set by every WorkManager publisher: the event's key, ``wm.events.key_of``) names its
event, the keys of :data:`SPEC`'s templates (``wm.dataplane.tasks.first_trip_templates``)
with the queue's id and that key put in. A pool process uses them only when the id and key
are its delivery's own, they are as many as it would read (its first delivery to a worker
also reads the code) and were read less than :data:`MAX_AGE_S` ago; else it reads them
itself, as it does for a message without the header, on RabbitMQ, Sentinel or a broker on
another server.

The facts are read when the node takes the message, a few milliseconds before it runs: a
worker suspended or paused in that time still runs the events the node took, as it runs one
already running. A stop does not: its question to every process (how many of the worker's
deliveries run here?) makes each read the facts itself for the events taken before it, and
find the worker stopping. An outcome another copy records meanwhile is still caught by the
record, whose first outcome wins and is the one published.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kombu.utils.encoding import bytes_to_str

#: The message header that carries the event's key (its publisher sets it).
KEY_HEADER = "wmkey"
#: The message header in which the node hands the facts to the pool process.
FACTS_HEADER = "wmfacts"
#: In a key template, where the worker's (or shared group's) id goes, and the event's key.
WORKER_MARK, EVENT_MARK = "\x01", "\x02"
#: Oldest facts a delivery uses (s): a message that waited longer in the node's prefetch
#: window reads its own.
MAX_AGE_S = 0.25
#: Length of a worker's (or shared group's) id, a UUID's text.
_ID_LENGTH = 36

# The script's F: '' (off) or the JSON {"db": [state store's database, broker's], "keys":
# the templates}. facts(queue, decoded message or nil, message, F) returns {the id, the
# event's key, the keys' values} or false.
FACTS = f"""
local function facts(queue, m, message, F)
  if F == '' then return false end
  local id = string.match(queue, '::([^:]+)$')
  if not id or #id ~= {_ID_LENGTH} then return false end
  if not m then
    local ok, decoded = pcall(cjson.decode, message)
    if not ok or type(decoded) ~= 'table' then return false end
    m = decoded
  end
  local key = type(m.headers) == 'table' and m.headers.{KEY_HEADER}
  if type(key) ~= 'string' then return false end
  local spec = cjson.decode(F)
  local names = {{}}
  for i, template in ipairs(spec.keys) do
    local name = string.gsub(template, '\\1', function() return id end)
    names[i] = string.gsub(name, '\\2', function() return key end)
  end
  redis.call('SELECT', spec.db[1])
  local values = redis.call('MGET', unpack(names))
  redis.call('SELECT', spec.db[2])
  return {{id, key, values}}
end
"""


class _Spec:
    """This node's F (``''``: off), set once it serves (:func:`offer`)."""

    text = ""


SPEC = _Spec()


def offer(databases: tuple[int, int] | None, templates: list[str]) -> None:
    """Have this node's take scripts read ``templates`` (keys with :data:`WORKER_MARK` and
    :data:`EVENT_MARK`) from the state store's database: ``databases`` is (its number, the
    broker's) where the broker is a database of its server, else None (off)."""
    SPEC.text = "" if databases is None else json.dumps({"db": databases, "keys": templates})


def facts_args() -> list[str]:
    """The F of :data:`FACTS` for a take now."""
    return [SPEC.text]


def hand_over(message: Any, read: Any) -> None:
    """Put what the take read (``read``, the script's reply, or None) in ``message``'s
    :data:`FACTS_HEADER`, with the time; a header the message came with is dropped, so a
    pool process never takes facts from a publisher."""
    headers = message.get("headers") if isinstance(message, dict) else None
    if not isinstance(headers, dict):
        return
    headers.pop(FACTS_HEADER, None)
    if not read:
        return
    worker, key, values = read
    try:
        texts = [None if v is None else v.decode() for v in values]
    except UnicodeDecodeError:  # never from WorkManager's keys: read them in the pool
        return
    headers[FACTS_HEADER] = [time.time(), bytes_to_str(worker), bytes_to_str(key), texts]


def taken(
    headers: dict[str, Any] | None, worker_id: str, event_key: str, after: float = 0.0
) -> list[Any] | None:
    """The values a take read for the delivery to ``worker_id`` of the event ``event_key``,
    from the request's ``headers``; None where they are not the delivery's own, too old, read
    before ``after`` (when the process last heard a stop's command about the worker), or
    the node did not read them (the delivery reads them). Only where the node's Redis
    transport hands the facts over (:func:`hand_over`), which drops any a publisher put in
    the message."""
    if not isinstance(headers, dict):
        return None
    handed = headers.pop(FACTS_HEADER, None)  # not carried into a retry's message
    if not (isinstance(handed, list) and len(handed) == 4):
        return None
    at, worker, key, values = handed
    fresh = isinstance(at, float) and at > after and 0 <= time.time() - at < MAX_AGE_S
    if fresh and worker == worker_id and key == event_key and isinstance(values, list):
        return values
    return None
