"""What every part of the control plane works with: the settings, who asks, and the data
plane's bus with the lifecycle outbox. The data plane is imported on first use: a part that
only reads the store never loads it, so ``wm worker list`` starts without Celery or kombu."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from wm.config import Settings

if TYPE_CHECKING:
    from wm.dataplane.bus import Bus


class Context:
    def __init__(self, settings: Settings, actor: str, bus: Bus | None = None) -> None:
        self.settings = settings
        #: Who the transitions made here are recorded as asked by (``cli`` for ``wm``).
        self.actor = actor
        self._bus = bus

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            from wm.dataplane.bus import Bus

            self._bus = Bus(self.settings)
        return self._bus

    def changed(self, wid: uuid.UUID) -> None:
        """After a committed change of the worker: nodes re-read it, and the lifecycle events
        the change wrote to the outbox are published."""
        from wm.dataplane import outbox

        outbox.changed(self.settings, self.bus, wid)

    def flush_outbox(self) -> int:
        """Publish lifecycle events written by committed changes; returns how many were sent."""
        from wm.dataplane import outbox

        return outbox.flush(self.settings, self.bus)
