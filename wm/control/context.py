"""What every part of the control plane works with: the settings, who asks, and the data
plane's bus with the lifecycle outbox. The data plane is imported on first use: a part that
only reads the store never loads it, so ``wm worker list`` starts without Celery or kombu."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from wm.config import Settings
from wm.names import DEFAULT_TENANT, check_name, route_topic

if TYPE_CHECKING:
    from wm.dataplane.bus import Bus


class Context:
    def __init__(
        self, settings: Settings, actor: str, bus: Bus | None = None, tenant: str = DEFAULT_TENANT
    ) -> None:
        self.settings = settings
        #: Who the transitions made here are recorded as asked by (``cli`` for ``wm``).
        self.actor = actor
        #: The tenant every call made here works in (checked and known to exist).
        self.tenant = tenant
        self._bus = bus

    def route(self, topic: object, kind: str = "topic") -> str:
        """The route topic (``wm.names.route_topic``) of a topic named in this tenant, once
        it is checked as a ``kind`` name."""
        return route_topic(self.tenant, check_name(kind, topic))

    def route_filter(self, topic: str | None) -> str | None:
        """The route topic a listing's topic filter means (unchecked, as before tenants: a
        filter no topic matches lists nothing; the tenant is filtered on besides)."""
        return None if topic is None else route_topic(self.tenant, topic)

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
