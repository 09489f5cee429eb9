"""The engine contract: ``load`` (validate and prepare), ``process``, ``close``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from wm.config import Settings
from wm.events import CloudEvent


@dataclass(frozen=True)
class WorkerSpec:
    """What an engine may know about the worker whose code it runs."""

    worker_id: str
    topic: str
    group: str | None = None
    version: int = 1
    sha256: str = ""
    name: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)


class Engine:
    """Runs one worker's code. One instance per worker per process, reused across events.

    ``load`` may be called again with new code (hot reload); an engine must finish calls in
    flight on the old code before the new code takes effect.
    """

    #: MIME type the engine is registered for (informational; the entry point decides).
    mime_type: ClassVar[str] = ""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def validate(self, code: bytes, worker: WorkerSpec) -> None:
        """Refuse bad code with :class:`wm.errors.InvalidCode`; default: load, then close."""
        try:
            self.load(code, worker)
        finally:
            self.close()

    def load(self, code: bytes, worker: WorkerSpec) -> None:
        """Validate and prepare ``code``; raise :class:`wm.errors.InvalidCode` if it is bad."""
        raise NotImplementedError("Engine.load() must be implemented.")

    def process(self, event: CloudEvent, timeout_s: float) -> list[CloudEvent]:
        """Run the code on ``event`` and return the events it produced (maybe none)."""
        raise NotImplementedError("Engine.process() must be implemented.")

    def close(self) -> None:
        """Release what ``load`` acquired. Safe to call more than once."""
