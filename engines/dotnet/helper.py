"""The helper process of an isolated .NET worker: ``python -m engines.dotnet.helper``.

It starts a runtime of its own, loads the worker the host sends (compiling C# source here)
into a context, and answers calls, events and probes alike (a :class:`~engines.dotnet.wire.Request`
each), with the same strings an in-process context gives; the worker's log lines and gateway
calls travel to the host. A worker that hangs, crashes the runtime or exhausts its memory
takes only this process (the frames, die-with-parent and the serve loop are
:mod:`engines.isolation.helper`).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from engines.dotnet.engine import Context, Image
from engines.dotnet.wire import EVENT, Request
from engines.isolation.helper import Host, run
from wm.config import Settings
from wm.engine import WorkerSpec


class HostSinks:
    """The worker's log and gateway, relayed to the host over the pipes."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.deadline = threading.local()

    def log(self, level: int, message: str) -> None:
        self.host.log(level, message)

    def gateway(self, service: str, method: str, request: bytes) -> tuple[int, bytes]:
        return self.host.gateway(service, method, request)


class Handler:
    def __init__(self, context: Context) -> None:
        self.context = context

    def call(self, payload: bytes) -> bytes:
        """An event's answer, or the probe's (a :class:`Request` of either kind)."""
        request = Request.decode(payload)
        limit_s = request.limit_ms / 1000
        if request.kind == EVENT:
            return self.context.process(request.header, request.data, limit_s).encode()
        return self.context.probe(limit_s).encode()

    def close(self) -> None:
        self.context.close()


def load(spec: dict[str, Any], blob: bytes, host: Host) -> Handler:
    settings = Settings.from_env()
    worker = WorkerSpec(worker_id=str(spec["worker_id"]), topic="")
    context = Context(settings, worker, Image.from_blob(spec, blob), HostSinks(host))
    return Handler(context)


if __name__ == "__main__":
    sys.exit(run(load))
