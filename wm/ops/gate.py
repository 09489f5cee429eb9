"""What every admin API request passes before FastAPI routes it or reads its body.

Three pure ASGI layers, outermost first, so that their order is the order of the checks:

- :class:`Gate`: the bearer token. No token, or one not in force, is a 401 before anything
  else is read or stored (looking the token up is the first and only database read);
- :class:`Audited`: every mutating call of a known token is written to the audit log before
  it runs and completed with its final status after it, a crash (500) included;
- :class:`BodyLimit`: a body over ``WM_API_MAX_BODY_BYTES`` is a 413, by its
  ``Content-Length`` before the call runs, or cut off while it streams in, so a huge body
  never sits in memory.

Errors name no service: a 503 says which kind of service failed, the log has the detail.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import quote

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wm.control.access import Audit, Tokens
from wm.errors import BrokerUnavailable, StoreUnavailable, Unavailable, WorkManagerError
from wm.text import storable

logger = logging.getLogger(__name__)

#: Methods that change something: each call is written to the audit log.
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: What a 503 calls each service (never its URL, driver, host or database name).
SERVICES: dict[type[Unavailable], str] = {
    StoreUnavailable: "the database",
    BrokerUnavailable: "the broker or Redis",
}


def problem(code: int, detail: str, kind: str, **headers: str) -> JSONResponse:
    """An error answer of the API: ``{"detail": …, "type": …}``."""
    body = {"detail": storable(detail), "type": kind}
    return JSONResponse(body, status_code=code, headers=headers)


def outage(exc: Unavailable) -> str:
    """A 503's text: which kind of service failed, and where the detail is."""
    service = next((n for k, n in SERVICES.items() if isinstance(exc, k)), "a service it needs")
    return f"{service} is unavailable to the API; try again later (its log has the detail)"


def _unauthorized(detail: str, challenge: str) -> JSONResponse:
    return problem(401, detail, "Unauthorized", **{"WWW-Authenticate": challenge})


class Gate:
    """Authenticate every request but those to ``public`` paths; the token found is put in
    the request's state (``request.state.token``)."""

    def __init__(self, app: ASGIApp, *, tokens: Tokens, public: frozenset[str]) -> None:
        self.app, self.tokens, self.public = app, tokens, public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public:
            return await self.app(scope, receive, send)
        refusal, token = await self._authenticate(Headers(scope=scope).get("authorization"))
        if refusal is not None:
            return await refusal(scope, receive, send)
        scope.setdefault("state", {})["token"] = token
        await self.app(scope, receive, send)

    async def _authenticate(self, header: str | None) -> tuple[JSONResponse | None, Any]:
        scheme, _, secret = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            no_token = "no bearer token: send 'Authorization: Bearer wm_…' (wm token create)"
            return _unauthorized(no_token, "Bearer"), None
        try:
            token = await run_in_threadpool(self.tokens.authenticate, secret.strip())
        except Unavailable as exc:
            logger.error("bearer token not checked, call refused: %s", exc)
            return problem(503, outage(exc), type(exc).__name__), None
        if token is None:
            unknown = "the bearer token is unknown, revoked or expired"
            return _unauthorized(unknown, 'Bearer error="invalid_token"'), None
        return None, token


class Audited:
    """Write each mutating call to the audit log: begun before it runs (or refused with 503
    when the log cannot be written), finished with the status it ended with."""

    def __init__(self, app: ASGIApp, *, audit: Audit) -> None:
        self.app, self.audit = app, audit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in MUTATING:
            return await self.app(scope, receive, send)
        started = time.monotonic()
        path = scope.get("raw_path", b"").decode("latin-1") or quote(scope["path"])
        remote = scope["client"][0] if scope.get("client") else None
        try:
            entry = await run_in_threadpool(self.audit.begin, scope["method"], path, remote)
        except WorkManagerError as exc:
            logger.error("audit log unavailable, call refused: %s", exc)
            detail = "the audit log cannot be written, nothing was done (the log has the detail)"
            return await problem(503, detail, type(exc).__name__)(scope, receive, send)
        status: list[int] = []
        try:
            await self.app(scope, receive, _watching(send, status))
        except Exception as exc:
            scope.setdefault("state", {}).setdefault("result", f"{type(exc).__name__}: {exc}")
            status.append(500)
            raise
        finally:
            code = status[0] if status else 500
            await self._finish(entry, scope, code, time.monotonic() - started)

    async def _finish(self, entry: int, scope: Scope, code: int, took_s: float) -> None:
        state = scope.get("state", {})
        result = state.get("result") or ("ok" if code < 400 else str(code))
        finish = functools.partial(
            self.audit.finish,
            entry,
            token=state.get("token"),
            action=_action(scope),
            status_code=code,
            result=result,
            duration_ms=took_s * 1000,
        )
        try:
            await run_in_threadpool(finish)
        except WorkManagerError as exc:  # the entry stays begun: the call is on record
            logger.error("audit entry %s could not be completed: %s", entry, exc)


def _watching(send: Send, status: list[int]) -> Callable[[Message], Awaitable[None]]:
    async def watched(message: Message) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        await send(message)

    return watched


def _action(scope: Scope) -> str:
    """``POST /v1/workers/{ref}/start ref=w``: the route and its parameters (as sent in the
    URL, percent-encoded), or the path when no route matched."""
    route = getattr(scope.get("route"), "path", scope["path"])
    params = scope.get("path_params") or {}
    named = " ".join(f"{k}={quote(str(v), safe='')}" for k, v in params.items())
    return f"{scope['method']} {route} {named}".rstrip()


class BodyLimit:
    """Refuse a request body over ``max_bytes`` with 413: at once by its ``Content-Length``,
    or as soon as a streamed (chunked) body passes the limit."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            scope.setdefault("state", {})["result"] = self._detail()
            too_large = problem(413, self._detail(), HTTPStatus(413).phrase)
            return await too_large(scope, receive, send)
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, self._detail())
            return message

        return counted

    def _detail(self) -> str:
        return (
            f"the request body is over {self.max_bytes} bytes (WM_API_MAX_BODY_BYTES); "
            "give code by url for a larger one"
        )
