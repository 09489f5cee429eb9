"""How an attempt ends: the verdicts of the delivery pipeline (``wm.dataplane.pipeline``),
carried out at the task's boundary (``wm.dataplane.tasks``)."""

from __future__ import annotations

from wm.dataplane.deadletters import Failure
from wm.dataplane.message import DeliveryState


class Verdict(Exception):
    """How an attempt ends. Raised by a feature's context to end it before it runs."""


class Done(Verdict):
    """The attempt succeeded: its outputs are recorded and published."""


#: The verdict of every successful attempt.
DONE = Done("done")


class Requeue(Verdict):
    """The message goes back to its queue unacknowledged (nothing about it is recorded);
    with ``pause``, after :data:`~wm.dataplane.delivery.REQUEUE_PAUSE_S`."""

    def __init__(self, reason: str, *, pause: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.pause = reason, pause


class Resend(Verdict):
    """The delivery is sent again in ``delay_s`` as a new message carrying ``state``, and
    this one is acknowledged. ``counts``: as the next attempt (a retry after a failure), or
    as the same one (a wait for a lock, which uses up no attempt)."""

    def __init__(
        self, delay_s: float, state: DeliveryState, error: Exception, *, counts: bool
    ) -> None:
        super().__init__(f"sent again in {delay_s:.2f}s: {error}")
        self.delay_s, self.state, self.error, self.counts = delay_s, state, error, counts


class Park(Verdict):
    """The delivery is dead-lettered (stored in ``<topic>-dead``) and acknowledged."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"{failure.error_type}: {failure.error_message}")
        self.failure = failure


class Settled(Verdict):
    """The message was settled by an earlier run whose pool process then ended on purpose
    (``wm.dataplane.watchdog``, ``Runtime.replace``): acknowledged, nothing else."""
