"""What every admin API request passes before FastAPI routes it or reads its body.

Four pure ASGI layers, outermost first, so that their order is the order of the checks:

- :class:`Gate`: the bearer token. No token, or one not in force, is a 401 before anything
  else is read or stored (looking the token up is the first and only database read); the
  tenant the call works in is settled here (:func:`working_tenant`). Under a
  :class:`Browser`'s paths (the console) the token comes from its session cookie instead,
  and a refusal is the browser's own answer (the login page), checked at the same point;
- :class:`Audited`: every mutating call of a known token is written to the audit log before
  it runs and completed with its final status after it, a crash (500) included;
- :class:`TenantGuard`: a tenant's token that names another tenant is a 403 (audited), the
  same whether that tenant exists or not;
- :class:`BodyLimit`: a body over ``WM_API_MAX_BODY_BYTES`` is a 413, by its
  ``Content-Length`` before the call runs, or cut off while it streams in, so a huge body
  never sits in memory.

Errors name no service: a 503 says which kind of service failed, the log has the detail.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import quote

from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wm.control.access import Audit, Tokens
from wm.errors import (
    BrokerUnavailable,
    Conflict,
    DeliveryFailed,
    Misconfigured,
    NotFound,
    Refused,
    StoreUnavailable,
    Unavailable,
    WorkManagerError,
)
from wm.names import DEFAULT_TENANT, TENANT_HEADER, TENANT_PATTERN
from wm.text import storable
from wm.views import Role, TokenInfo

logger = logging.getLogger(__name__)

#: Methods that change something: each call is written to the audit log.
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: What a 503 calls each service (never its URL, driver, host or database name).
SERVICES: dict[type[Unavailable], str] = {
    StoreUnavailable: "the database",
    BrokerUnavailable: "the broker or Redis",
}
_TENANT_NAME = re.compile(TENANT_PATTERN)
#: Status code of each group of errors (``wm.errors.GROUPS``); 422 ones are shaped like
#: FastAPI's validation errors. A failed delivery ends an attempt on a node, not a call: 400
#: is what any error outside these groups gets too.
ERROR_STATUS: dict[type[WorkManagerError], int] = {
    NotFound: 404,
    Conflict: 409,
    Refused: 422,
    Unavailable: 503,
    Misconfigured: 400,
    DeliveryFailed: 400,
}
#: Status code of an error under no group (the root, raised bare).
OTHER_ERROR_STATUS = 400
#: Why the gate turned a call away (the text of its 401).
NO_TOKEN = "no bearer token: send 'Authorization: Bearer wm_…' (wm token create)"
UNKNOWN_TOKEN = "the bearer token is unknown, revoked or expired"


def status_of(exc: WorkManagerError) -> int:
    """The status code of an error raised by a call (:data:`ERROR_STATUS`)."""
    return next(
        (code for group, code in ERROR_STATUS.items() if isinstance(exc, group)),
        OTHER_ERROR_STATUS,
    )


def needed_role(route: APIRoute) -> Role | None:
    """The role a route needs: the mark its role dependency carries (``wm.ops.api``'s
    ``VIEWER``, ``OPERATOR``, ``ADMIN``), None for a route any token may call."""
    marks = (getattr(d.dependency, "needed", None) for d in route.dependencies)
    return next((m for m in marks if m is not None), None)


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


@dataclass(frozen=True)
class Browser:
    """Calls under ``prefix`` come from a browser: ``session`` reads the token's secret and
    the tenant named from the request (a cookie), and a call without a token in force gets
    ``refuse(scope, reason)``'s answer rather than the API's 401."""

    prefix: str
    session: Callable[[Scope], tuple[str | None, str | None]]
    refuse: Callable[[Scope, str], ASGIApp]


class Gate:
    """Authenticate every request but those to ``public`` paths; the token found is put in
    the request's state (``request.state.token``). A public path ending in ``/`` is a prefix:
    it must be a mount's (static files), so that nothing under it reaches another route."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tokens: Tokens,
        public: frozenset[str],
        browser: Browser | None = None,
    ) -> None:
        self.app, self.tokens, self.browser = app, tokens, browser
        self.public = frozenset(p for p in public if not p.endswith("/"))
        self.public_prefixes = tuple(sorted(p for p in public if p.endswith("/")))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_public(scope["path"]):
            return await self.app(scope, receive, send)
        browser = self._browser_of(scope["path"])
        secret, named = self._credentials(scope, browser)
        refusal, token = await self._authenticate(secret)
        if refusal is not None:
            if browser is not None and refusal.status_code == 401:
                reason = UNKNOWN_TOKEN if secret else NO_TOKEN
                return await browser.refuse(scope, reason)(scope, receive, send)
            return await refusal(scope, receive, send)
        state = scope.setdefault("state", {})
        state["token"], state["tenant"] = token, working_tenant(token, named)
        state["foreign_tenant"] = token.tenant is not None and named not in (None, token.tenant)
        await self.app(scope, receive, send)

    def _is_public(self, path: str) -> bool:
        return path in self.public or path.startswith(self.public_prefixes)

    def _browser_of(self, path: str) -> Browser | None:
        if self.browser is not None and path.startswith(self.browser.prefix):
            return self.browser
        return None

    @staticmethod
    def _credentials(scope: Scope, browser: Browser | None) -> tuple[str | None, str | None]:
        """The token's secret and the tenant named: a browser's session, or the headers."""
        if browser is not None:
            return browser.session(scope)
        headers = Headers(scope=scope)
        scheme, _, secret = (headers.get("authorization") or "").partition(" ")
        bearer = secret.strip() if scheme.lower() == "bearer" else ""
        return bearer or None, headers.get(TENANT_HEADER)

    async def _authenticate(self, secret: str | None) -> tuple[JSONResponse | None, Any]:
        if secret is None:
            return _unauthorized(NO_TOKEN, "Bearer"), None
        try:
            token = await run_in_threadpool(self.tokens.authenticate, secret)
        except Unavailable as exc:
            logger.error("bearer token not checked, call refused: %s", exc)
            return problem(503, outage(exc), type(exc).__name__), None
        if token is None:
            return _unauthorized(UNKNOWN_TOKEN, 'Bearer error="invalid_token"'), None
        return None, token


def working_tenant(token: TokenInfo, named: str | None) -> str:
    """The tenant a call works in: a tenant token's own (whatever the call names); for a
    deployment-wide token, the tenant ``named`` in ``WM-Tenant``, the default one without it
    (or with a name no tenant can have, which the route then refuses with 422)."""
    if token.tenant is not None:
        return token.tenant
    if named is None or not _TENANT_NAME.fullmatch(named):
        return DEFAULT_TENANT
    return named


class TenantGuard:
    """Refuse, before the body is read, a call of a tenant's token that names another tenant
    (``WM-Tenant``): a 403 that reads the same whether that tenant exists or not, so a token
    learns nothing of tenants beyond its own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.get("state", {})
        if scope["type"] != "http" or not state.get("foreign_tenant"):
            return await self.app(scope, receive, send)
        token: TokenInfo = state["token"]
        detail = (
            f"token {token.name!r} works in tenant {token.tenant!r} only: it may not name "
            f"another tenant in {TENANT_HEADER} (a deployment-wide admin token may)"
        )
        state["result"] = detail
        await problem(403, detail, HTTPStatus(403).phrase)(scope, receive, send)


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
        tenant = scope.get("state", {}).get("tenant", DEFAULT_TENANT)
        try:
            begin = functools.partial(self.audit.begin, scope["method"], path, remote, tenant)
            entry = await run_in_threadpool(begin)
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
