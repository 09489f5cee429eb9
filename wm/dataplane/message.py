"""What a ``wm.deliver`` task message carries beside the worker id and the event.

Release 0.1 sent each piece of retry state as its own keyword argument (format 1:
``pin_version``, ``first_failure_at``, ``lock_waits``, ``waiting_since``, ``seq``). Format 2
sends one value, ``state``, a JSON object with its format number (``v``), so a node reads
the messages of every earlier release still in a queue: both formats are read, format 2 is
written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from wm.errors import InvalidArgument

#: The format this release writes.
FORMAT = 2
#: The keyword argument that carries the state in format 2.
STATE_KWARG = "state"
#: The fields that hold a ``time.time()``.
_TIMES = frozenset({"first_failure_at", "waiting_since"})


@dataclass(frozen=True)
class DeliveryState:
    """A delivery's state across its runs (retries and waits are new messages)."""

    #: the code version a replay asked for (None: the worker's current one)
    pin_version: int | None = None
    #: its number among the worker's events of one partition key (ordering: key)
    seq: int | None = None
    #: when its first attempt failed (``time.time()``)
    first_failure_at: float | None = None
    #: how often it waited for its group lock (or turn, or slot), and since when
    lock_waits: int = 0
    waiting_since: float | None = None

    def wire(self) -> dict[str, Any]:
        """The ``state`` keyword argument: the format and the fields that are set."""
        given = {k: v for k, v in asdict(self).items() if v not in (None, 0)}
        return {"v": FORMAT, **given}

    def kwargs(self) -> dict[str, Any]:
        """The task's keyword arguments carrying this state."""
        return {STATE_KWARG: self.wire()}

    def failed_at(self, now: float) -> DeliveryState:
        """Sent again after a failed attempt (the first failure's time kept)."""
        return replace(self, first_failure_at=self.first_failure_at or now)

    def waited(self, now: float) -> DeliveryState:
        """Sent again after a wait for its lock."""
        return replace(
            self, lock_waits=self.lock_waits + 1, waiting_since=self.waiting_since or now
        )

    @classmethod
    def read(cls, state: Mapping[str, Any] | None, legacy: Mapping[str, Any]) -> DeliveryState:
        """The state of a message of either format; refuses a key of neither."""
        given = dict(legacy)  # format 1: the state's fields as keyword arguments
        if state is not None:
            if not isinstance(state, Mapping):
                raise InvalidArgument(f"task argument {STATE_KWARG!r} must be an object")
            given.update({k: v for k, v in state.items() if k != "v"})
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise InvalidArgument(f"unknown delivery state {', '.join(unknown)}")
        given = {k: v for k, v in given.items() if v is not None}
        for name, value in given.items():
            _check(name, value)
        return cls(**given)


def _check(name: str, value: Any) -> None:
    """Refuse a state field that is not what this release writes (a finite number; a whole
    one but for the two times), rather than fail on it later at every run."""
    kinds = (int, float) if name in _TIMES else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        expected = "a number" if name in _TIMES else "a whole number"
        raise InvalidArgument(f"delivery state {name} must be {expected}, not {value!r:.40}")


def numbered(kwargs: Mapping[str, Any] | None, seq: int) -> dict[str, Any]:
    """A task's keyword arguments (of either format) in format 2, with its number ``seq``."""
    given = dict(kwargs or {})
    state = DeliveryState.read(given.pop(STATE_KWARG, None), given)
    return replace(state, seq=seq).kwargs()
