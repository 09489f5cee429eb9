"""Immutable views of workers, versions and transitions returned by the API (never ORM rows)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from wm.errors import InvalidArgument
from wm.models import Worker, WorkerTransition, WorkerVersion

#: Per-worker settings and their types; anything else is refused.
WORKER_SETTINGS: dict[str, type | tuple[type, ...]] = {
    "timeout_s": (int, float),
    "max_retries": int,
    "retry_base_delay_ms": int,
    "memory_mb": int,
    "cpu_limit_s": (int, float),
}


def validate_worker_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Check per-worker settings: known keys, right types, non-negative numbers."""
    checked: dict[str, Any] = {}
    for key, value in settings.items():
        expected = WORKER_SETTINGS.get(key)
        if expected is None:
            raise InvalidArgument(
                f"unknown worker setting {key!r}; known: {', '.join(sorted(WORKER_SETTINGS))}"
            )
        if isinstance(value, bool) or not isinstance(value, expected) or value < 0:  # type: ignore[operator]
            raise InvalidArgument(f"worker setting {key!r} must be a non-negative number")
        checked[key] = value
    return checked


@dataclass(frozen=True)
class WorkerInfo:
    id: uuid.UUID
    name: str | None
    topic: str
    group: str | None
    mime_type: str
    status: str
    current_version: int
    sha256: str
    size: int
    settings: Mapping[str, Any]
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, worker: Worker, version: WorkerVersion) -> WorkerInfo:
        return cls(
            id=worker.id,
            name=worker.name,
            topic=worker.topic,
            group=worker.group,
            mime_type=worker.mime_type,
            status=worker.status,
            current_version=worker.current_version,
            sha256=version.sha256,
            size=version.size,
            settings=dict(worker.settings or {}),
            created_at=worker.created_at,
            updated_at=worker.updated_at,
        )

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass(frozen=True)
class VersionInfo:
    worker_id: uuid.UUID
    version: int
    source_kind: str
    url: str | None
    sha256: str
    size: int
    created_at: datetime
    note: str | None

    @classmethod
    def of(cls, row: WorkerVersion) -> VersionInfo:
        return cls(
            row.worker_id,
            row.version,
            row.source_kind,
            row.url,
            row.sha256,
            row.size,
            row.created_at,
            row.note,
        )

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass(frozen=True)
class TransitionInfo:
    worker_id: uuid.UUID
    from_status: str | None
    to_status: str
    reason: str
    version: int | None
    at: datetime

    @classmethod
    def of(cls, row: WorkerTransition) -> TransitionInfo:
        return cls(row.worker_id, row.from_status, row.to_status, row.reason, row.version, row.at)

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, uuid.UUID):
            value = str(value)
        elif isinstance(value, datetime):
            value = value.isoformat()
        out[key] = value
    return out
