"""Checks of a batch of events before ``WorkManager.publish_many`` sends any of it."""

from __future__ import annotations

from collections.abc import Iterable

from wm.errors import InvalidArgument, WorkManagerError
from wm.events import CloudEvent
from wm.names import check_name


def checked(events: Iterable[CloudEvent], topic: str | None = None) -> list[tuple[CloudEvent, str]]:
    """Each event with the topic it goes to (``topic``, else its type); the first event that
    is no CloudEvent or whose topic is no valid name raises :class:`InvalidArgument` naming
    its index (from 0), before anything is sent."""
    found = []
    for index, event in enumerate(events):
        if not isinstance(event, CloudEvent):
            raise InvalidArgument(f"event {index}: not a CloudEvent but {type(event).__name__}")
        try:
            found.append((event, check_name("topic", topic or event.get_type())))
        except WorkManagerError as exc:
            raise InvalidArgument(f"event {index}: {exc}") from exc
    return found
