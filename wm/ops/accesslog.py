"""The admin API's access log and the line that says where it listens.

uvicorn's access log names the client, the request line and the status: no duration, no
caller, and its own text format whatever WM_LOG_FORMAT says. Here one record per request,
on logger ``wm.api.access``: method, path, status, duration and the calling token's id (its
secret never), a JSON object with WM_LOG_FORMAT=json.
"""

from __future__ import annotations

import logging
import sys
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wm.config import Settings
from wm.ops.logs import level_of

#: The logger of the access log.
ACCESS_LOGGER = "wm.api.access"
logger = logging.getLogger(ACCESS_LOGGER)


class AccessLog:
    """Log each request once it is answered. The outermost middleware: it sees every
    answer, the gate's refusals included, and the token the gate found (``state``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        status = [500]  # an app that raised before answering: the server answers 500

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            _log(scope, status[0], (time.monotonic() - started) * 1000)


def _log(scope: Scope, status: int, duration_ms: float) -> None:
    token = scope.get("state", {}).get("token")
    fields = {
        "method": scope["method"],
        "path": scope["path"],
        "status": status,
        "duration_ms": round(duration_ms, 1),
        "token_id": token.id if token is not None else None,
    }
    caller = f" token={token.id}" if token is not None else ""
    logger.info(
        "%s %s %d %.1f ms%s",
        scope["method"],
        scope["path"],
        status,
        duration_ms,
        caller,
        extra=fields,
    )


def enable(settings: Settings) -> None:
    """Let the access log through at WM_LOG_LEVEL's default (WARNING) too: a server's
    requests are what its operator looks at first. WM_LOG_LEVEL=ERROR silences it."""
    if level_of(settings) <= logging.WARNING:
        logger.setLevel(min(logging.INFO, level_of(settings)))


def announce(settings: Settings, url: str) -> None:
    """One line on standard error: where the API listens and its docs (a JSON log line
    with WM_LOG_FORMAT=json, so the stream stays one format)."""
    text = f"wm api listening on {url} (docs: {url}/docs, console: {url}/console/)"
    if settings.log_format == "json":
        extra = {"url": url, "docs": f"{url}/docs", "console": f"{url}/console/"}
        logger.warning(text, extra=extra)
    else:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
