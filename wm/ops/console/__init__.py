"""The worker console: the admin API's pages for a browser (``/console/``), served by
``wm api`` itself with no script and nothing from another site.

Viewers read; operators and admins act through forms, each needing the role of the JSON
route it mirrors. A browser logs in by pasting an API token, kept in an HttpOnly,
SameSite=Strict cookie (``wm.ops.console.session``), which the API's gate checks on every
call before anything else is read, as it checks bearer tokens (``wm.ops.gate.Browser``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib import resources

from fastapi import APIRouter, FastAPI, Request
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.responses import RedirectResponse, Response

from wm.errors import NotFound, WorkManagerError
from wm.names import TENANT_PATTERN
from wm.ops import gate
from wm.ops.console import pages, session
from wm.views import TokenInfo

__all__ = ["add_console", "browser"]

#: Where the console's style sheet is served (a mount, needing no token).
ASSETS = "/console/static"
#: The login page's text when the gate sent a browser back because its token went.
EXPIRED = "Your token is unknown, revoked or expired: paste one in force."
ENTRY = APIRouter(prefix="/console", include_in_schema=False)


def add_console(app: FastAPI, api: Iterable[APIRouter]) -> frozenset[str]:
    """Add the console to ``app``, each of its actions needing the role of its JSON route
    among ``api``'s; the paths that need no token are returned, the mount's as a prefix."""
    app.state.console_roles = pages.roles_of(api)
    app.mount(ASSETS, StaticFiles(directory=str(resources.files(__name__) / "static")))
    app.include_router(ENTRY)
    app.include_router(pages.PAGES)
    return frozenset({"/console", session.LOGIN, f"{ASSETS}/"})


def browser() -> gate.Browser:
    """How the gate authenticates the console's calls."""
    return gate.Browser(session.PREFIX, session.credentials, session.refuse)


@ENTRY.get("")
def entry(request: Request) -> Response:
    return RedirectResponse(pages.base(request) + "/", 307)


@ENTRY.get("/login")
def login_page(request: Request) -> Response:
    error = EXPIRED if request.query_params.get("expired") else None
    return pages.page(request, "login.html", {"error": error})


@ENTRY.post("/login")
async def login(request: Request) -> Response:
    """Check the pasted token as the gate does, and keep it in the session cookie."""
    form = await request.form()
    secret = str(form.get("token", "")).strip()
    named = str(form.get("tenant", "")).strip() or None
    tokens = request.app.state.services.manager.tokens
    try:
        token: TokenInfo | None = await run_in_threadpool(tokens.authenticate, secret)
        error = None if token is None else await _tenant_problem(request, token, named)
    except WorkManagerError as exc:
        return pages.failed(request, exc)
    if token is None or error is not None:
        error = error or f"{gate.UNKNOWN_TOKEN}: paste a token from wm token create"
        request.state.result = error
        return pages.page(request, "login.html", {"error": error, "named": named}, 401)
    kept = session.begin(secret, named if token.tenant is None else None)
    response = RedirectResponse(pages.base(request) + "/", 303)
    session.keep(response, kept, secure=request.url.scheme == "https")
    return response


async def _tenant_problem(request: Request, token: TokenInfo, named: str | None) -> str | None:
    """Why the tenant asked for cannot be worked in with ``token``, or None."""
    if named is None or token.tenant == named:
        return None
    if token.tenant is not None:
        return f"token {token.name!r} works in tenant {token.tenant!r} only: leave tenant empty"
    if not re.fullmatch(TENANT_PATTERN, named):
        return f"tenant: {named!r} is no tenant name ({TENANT_PATTERN})"
    try:
        await run_in_threadpool(request.app.state.services.of_tenant, named)
    except NotFound as exc:
        return str(exc)
    return None


@ENTRY.post("/logout")
async def logout(request: Request) -> Response:
    form = await request.form()
    found = session.of_scope(request.scope)
    if found is None or not found.proves(form.get("csrf")):
        return pages.failure(request, 403, pages.STALE_FORM)
    response = RedirectResponse(pages.base(request) + "/login", 303)
    session.forget(response)
    return response
