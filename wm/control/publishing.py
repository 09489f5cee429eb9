"""Checks of a batch of events before ``WorkManager.publish_many`` sends any of it."""

from __future__ import annotations

from collections.abc import Iterable

from wm.errors import InvalidArgument, WorkManagerError
from wm.events import CloudEvent, in_tenant
from wm.names import DEFAULT_TENANT, check_name, route_topic


def checked(
    events: Iterable[CloudEvent], topic: str | None = None, tenant: str = DEFAULT_TENANT
) -> list[tuple[CloudEvent, str]]:
    """Each event, as published in ``tenant`` (``wm.events.in_tenant``), with the route topic
    it goes to (``topic``, else its type, in ``tenant``); the first event that is no
    CloudEvent or whose topic is no valid name raises :class:`InvalidArgument` naming its
    index (from 0), before anything is sent."""
    found = []
    routed: dict[object, str] = {}  # each name checked once: a batch mostly has a few
    for index, event in enumerate(events):
        if not isinstance(event, CloudEvent):
            raise InvalidArgument(f"event {index}: not a CloudEvent but {type(event).__name__}")
        name = topic or event.get_type()
        try:
            to = routed.get(name) if isinstance(name, str) else None
            if to is None:
                to = routed[name] = route_topic(tenant, check_name("topic", name))
            found.append((in_tenant(event, tenant), to))
        except WorkManagerError as exc:
            raise InvalidArgument(f"event {index}: {exc}") from exc
    return found
