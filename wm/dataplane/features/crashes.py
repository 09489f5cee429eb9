"""Runs that ended with their process: a message the broker delivers again because the
process that had it died is counted (``wm.state.ledger``). Runs end with the outcome's record
or an error; when they keep ending with their process (a crash in code that shares it, such
as in-process native code, or a node killed every time), the event is parked past the
worker's attempts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import NOTHING, Feature
from wm.errors import WorkerCrashed


class CrashCount(Feature):
    def around_run(self, delivery: Delivery) -> AbstractContextManager[object]:
        return _counted(delivery) if delivery.redelivered else NOTHING


@contextmanager
def _counted(delivery: Delivery) -> Iterator[None]:
    """A redelivered run counted in the ledger until it ends (if the process survives)."""
    ledger, owner = delivery.rt.ledger, delivery.owner  # the share's, if it came through one
    runs = ledger.begin_run(owner, delivery.key)
    if runs > delivery.max_retries:
        raise WorkerCrashed(
            f"the process running worker {delivery.meta.id} on event {delivery.event.get_id()} "
            f"died {runs} times before finishing it; the event is parked instead of run "
            "again (code that crashes its process, such as in-process native code, "
            "is contained by isolation 'subprocess')"
        )
    try:
        yield
    except BaseException:  # the run ended, if not well: it did not take the process down
        ledger.end_run(owner, delivery.key)
        raise
