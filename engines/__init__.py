"""Engines run worker code. Each is registered for a MIME type in the ``wm.engines``
entry-point group, so a new engine needs no change to the core."""

from engines.base import Engine, WorkerSpec
from engines.registry import engine_class, registered_mime_types

__all__ = ["Engine", "WorkerSpec", "engine_class", "registered_mime_types"]
