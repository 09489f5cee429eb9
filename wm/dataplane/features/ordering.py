"""``ordering: key``: events of one ``partitionkey`` run one at a time, in publish order.

Each event of an ordering worker is numbered per key as it is sent (``wm.state.ordering``);
a delivery runs in its turn (before it :class:`~wm.state.ordering.NotYourTurn` sends it
again, see ``contention``), and its success or dead letter ends the turn. A number that never
comes is skipped after ``ordering_gap_s``. In a batch, the events of one key run in
successive calls (:meth:`Ordering.batch_key`), each after the turn of the one before ended.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager

from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import NOTHING, Feature
from wm.dataplane.verdicts import Done, Park, Verdict
from wm.state import ordering
from wm.state.ordering import PARTITION_EXTENSION, NotYourTurn

logger = logging.getLogger(__name__)


def _partition(delivery: Delivery) -> str | None:
    """The key of an ordered delivery (None: unordered, or numbered by no sender)."""
    partition = delivery.event.get_extension(PARTITION_EXTENSION)
    if delivery.state.seq is None or not delivery.worker_settings.ordered:
        return None
    return partition if isinstance(partition, str) else None


class Ordering(Feature):
    owns = ("ordering", "ordering_gap_s")

    def admit(self, delivery: Delivery) -> AbstractContextManager[object]:
        partition = _partition(delivery)
        if partition is not None:
            self._take(delivery, partition)
        return NOTHING

    def _take(self, delivery: Delivery, partition: str) -> None:
        seq, gap_s = delivery.state.seq, delivery.worker_settings.ordering_gap_s
        assert seq is not None
        verdict, due = delivery.rt.ordering.turn(delivery.meta.id, partition, seq, gap_s)
        if verdict == ordering.WAIT:
            raise NotYourTurn(
                f"key {partition!r} of worker {delivery.meta.id} is at event {due}; this is "
                f"event {seq} (ordering: key)"
            )
        if verdict == ordering.SKIP:
            logger.warning(
                "key %r of worker %s waited %g s for event %d, which never came; going on at %d",
                partition,
                delivery.meta.id,
                gap_s,
                due,
                seq,
            )

    def batch_key(self, delivery: Delivery) -> str | None:
        return _partition(delivery)

    def awaits_record(self, delivery: Delivery) -> bool:
        # the turn moves on once the delivery is done: only once its outcome is written
        return _partition(delivery) is not None

    def ended(self, delivery: Delivery, verdict: Verdict) -> None:
        partition = _partition(delivery)
        if partition is not None and isinstance(verdict, Done | Park):
            assert delivery.state.seq is not None
            delivery.rt.ordering.advance(delivery.meta.id, partition, delivery.state.seq)
