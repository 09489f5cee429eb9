"""JSON log lines (WM_LOG_FORMAT=json), apart from ``wm.ops.logs`` so that a command logging
as text does not import python-json-logger."""

from __future__ import annotations

from typing import Any

from pythonjsonlogger.json import JsonFormatter


class JsonLines(JsonFormatter):
    """python-json-logger's formatter with the time (the field its ``timestamp`` names)
    first, where a reader looks for it."""

    #: Installed by ``wm.ops.logs`` (which does not import this module to ask).
    WORKMANAGER = True

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        field = str(self.timestamp)
        return {field: log_data.pop(field), **log_data}
