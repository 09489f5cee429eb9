"""Session affinity (seed 004's ``SessionAffinity``): which engine instance a session is bound
to, and the call queue through which another process hands that instance its events.

An *instance* is one pool process of one node (``<node>/<pid>``): the process whose engines
hold a worker's in-memory state. It announces itself with ``wm:aff:inst:<instance>``, a key
it renews every :data:`BEAT_S` and that lapses :data:`INSTANCE_TTL_MS` after (its process or
node gone); the key's absence is what "the instance is gone" means.

A binding is ``wm:aff:{<worker>}:s:<session>`` → instance, with the worker's idle expiry
(``session_idle_s``), renewed by each event of the session as it arrives and once its
outcome is recorded: Redis expires idle bindings itself, so no sweeper is needed. Binding
and lookup are one script on the binding's key (:meth:`Affinity.claim`); a binding whose
instance is gone is taken over with a compare and set (:meth:`Affinity.take_over`), so two
processes never both rebind one session. Every key of one script has one hash slot (Redis
Cluster).

A call handed to an instance is a JSON request pushed on ``wm:aff:inst:<instance>:calls``;
the instance's answer comes on the request's own reply list, read in slices of
:data:`BEAT_S` so a caller notices the instance go away while it waits.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from wm.config import Settings
from wm.state.connection import StatePipeline, redis_errors, redis_for, text

#: How often an instance renews its key, and the slice a caller waits for an answer in.
BEAT_S = 1.0
#: An instance's key lapses this long after its last renewal (its process or node is gone).
INSTANCE_TTL_MS = 4000
HIT, MISS, ELSEWHERE = "hit", "miss", "elsewhere"

# KEYS: the binding. ARGV: this instance, idle expiry (ms). Returns {verdict, bound instance}:
# bound here (renewed), newly bound here, or bound to another instance (renewed; the caller
# checks that it lives).
_CLAIM = """
local bound = redis.call('GET', KEYS[1])
if not bound then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {'miss', ARGV[1]}
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if bound == ARGV[1] then return {'hit', bound} end
return {'elsewhere', bound}
"""
# KEYS: the binding. ARGV: the gone instance, this one, idle expiry (ms). Rebinds here when
# still bound to the gone one (or to none); returns the instance bound now.
_TAKE_OVER = """
local bound = redis.call('GET', KEYS[1])
if bound and bound ~= ARGV[1] then return bound end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return ARGV[2]
"""


def binding_key(worker_id: str, session: str) -> str:
    return f"wm:aff:{{{worker_id}}}:s:{session}"


def instance_key(instance: str) -> str:
    return f"wm:aff:inst:{instance}"


def calls_key(instance: str) -> str:
    return f"{instance_key(instance)}:calls"


def idle_ms(idle_s: float) -> int:
    return max(1, int(idle_s * 1000))


def queue_renewal(
    pipe: StatePipeline, worker_id: str, session: str, instance: str, idle_s: float
) -> None:
    """Renew a binding in ``pipe`` once its event's outcome is recorded: a session is idle
    from the end of its last call. Lapsed meanwhile (a call longer than its expiry), it
    binds again to ``instance``, which ran the call and holds the session's state."""
    key, ttl_ms = binding_key(worker_id, session), idle_ms(idle_s)
    pipe.set(key, instance, nx=True, px=ttl_ms)
    pipe.pexpire(key, ttl_ms)


class Affinity:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def _redis(self) -> Any:
        return redis_for(self.settings)

    def claim(self, worker_id: str, session: str, me: str, idle_s: float) -> tuple[str, str]:
        """(:data:`HIT` | :data:`MISS` | :data:`ELSEWHERE`, the instance bound). ``idle_s``:
        how long the binding lives now (the caller adds the call's time limit)."""
        with redis_errors(self.settings):
            verdict, bound = self._redis().eval(
                _CLAIM, 1, binding_key(worker_id, session), me, idle_ms(idle_s)
            )
        return text(verdict), text(bound)

    def take_over(self, worker_id: str, session: str, gone: str, me: str, idle_s: float) -> str:
        """Bind the session here if it is still bound to ``gone``; the instance bound now."""
        with redis_errors(self.settings):
            bound = self._redis().eval(
                _TAKE_OVER, 1, binding_key(worker_id, session), gone, me, idle_ms(idle_s)
            )
        return text(bound)

    def bound(self, worker_id: str, session: str) -> str | None:
        """The instance the session is bound to (None: unbound or expired)."""
        with redis_errors(self.settings):
            found = self._redis().get(binding_key(worker_id, session))
        return None if found is None else text(found)

    def binding(self, worker_id: str, session: str) -> tuple[str | None, float | None]:
        """The instance the session is bound to and the seconds its binding has left
        (None, None: unbound or expired)."""
        with redis_errors(self.settings):
            pipe = self._redis().pipeline(transaction=False)
            pipe.get(binding_key(worker_id, session))
            pipe.pttl(binding_key(worker_id, session))
            found, left_ms = pipe.execute()
        if found is None:
            return None, None
        return text(found), max(0, int(left_ms)) / 1000

    def unbind(self, worker_id: str, session: str) -> bool:
        """End the session's binding; its next event binds anew. False: it had none."""
        with redis_errors(self.settings):
            return bool(self._redis().delete(binding_key(worker_id, session)))

    def alive(self, instance: str) -> bool:
        with redis_errors(self.settings):
            return bool(self._redis().exists(instance_key(instance)))

    def renew(self, instance: str) -> None:
        """This instance lives (for :data:`INSTANCE_TTL_MS`)."""
        with redis_errors(self.settings):
            self._redis().set(instance_key(instance), "1", px=INSTANCE_TTL_MS)

    def forget_worker(self, worker_id: str) -> None:
        """A deleted worker's bindings."""
        with redis_errors(self.settings):
            client = self._redis()
            found = client.scan_iter(match=f"wm:aff:{{{worker_id}}}:*", count=500)
            keys = [text(k) for k in found]
            for start in range(0, len(keys), 500):
                client.delete(*keys[start : start + 500])

    def ask(self, instance: str, request: dict[str, Any], wait_s: float) -> dict[str, Any] | None:
        """Hand ``request`` to ``instance`` and wait at most ``wait_s`` for its answer; None
        when the instance went away first (or never took the request in time)."""
        reply = f"{instance_key(instance)}:reply:{uuid.uuid4().hex}"
        body = json.dumps({**request, "reply": reply})
        ttl_ms = int(wait_s * 1000) + INSTANCE_TTL_MS
        with redis_errors(self.settings):
            client = self._redis()
            with client.pipeline(transaction=False) as pipe:
                pipe.rpush(calls_key(instance), body)
                pipe.pexpire(calls_key(instance), ttl_ms)
                pipe.execute()
            waited = 0.0
            while waited < wait_s:
                found = client.blpop([reply], timeout=BEAT_S)
                if found is not None:
                    return dict(json.loads(found[1]))
                waited += BEAT_S
                if not client.exists(instance_key(instance)):
                    return None
        return None

    def next_call(self, instance: str) -> dict[str, Any] | None:
        """The next request handed to this instance (waits at most :data:`BEAT_S`)."""
        with redis_errors(self.settings):
            found = self._redis().blpop([calls_key(instance)], timeout=BEAT_S)
        return None if found is None else dict(json.loads(found[1]))

    def answer(self, reply: str, answer: dict[str, Any]) -> None:
        with redis_errors(self.settings), self._redis().pipeline(transaction=False) as pipe:
            pipe.rpush(reply, json.dumps(answer))
            pipe.pexpire(reply, INSTANCE_TTL_MS * 4)
            pipe.execute()
