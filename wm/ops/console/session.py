"""A browser's session with the console: the API token in a cookie, and the form token that
proves a POST was sent by one of the console's own pages.

The cookie holds the token's secret as the user pasted it (HttpOnly: no script reads it;
SameSite=Strict: no other site's page sends it; Secure over https), a random session id
drawn at login, and the tenant a deployment-wide token chose. The API's gate reads it where
it reads a bearer header for the JSON routes (``wm.ops.gate.Browser``), so the console's
calls are authenticated, audited and kept to their tenant by the same code.

Each form carries :func:`form_token`: an HMAC of the session id keyed by the token's secret.
It is new at each login, needs no server-side state (any API replica checks it), and cannot
be made without the secret that only the cookie holds.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from starlette.requests import HTTPConnection
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Scope

#: The session cookie's name, and the paths the console answers on.
COOKIE = "wm_console"
PREFIX = "/console/"
HOME = "/console/"
LOGIN = "/console/login"
#: Random bytes of a session id.
SESSION_ID_BYTES = 16
#: What a form token is keyed for (so it is of use nowhere else).
_PURPOSE = b"wm console form"


@dataclass(frozen=True)
class Session:
    sid: str
    #: The tenant a deployment-wide token chose at login (None: the default one, or a
    #: tenant's token, which always works in its own).
    tenant: str | None
    secret: str

    def cookie(self) -> str:
        """The cookie's value: none of the three parts holds a dot."""
        return f"{self.sid}.{self.tenant or ''}.{self.secret}"

    def form_token(self) -> str:
        message = _PURPOSE + b":" + self.sid.encode()
        return hmac.new(self.secret.encode(), message, hashlib.sha256).hexdigest()

    def proves(self, submitted: object) -> bool:
        """Whether a form's ``csrf`` field is this session's form token."""
        return isinstance(submitted, str) and hmac.compare_digest(submitted, self.form_token())


def begin(secret: str, tenant: str | None) -> Session:
    """A new session of the token ``secret`` (a fresh id: a fresh form token)."""
    return Session(secrets.token_urlsafe(SESSION_ID_BYTES), tenant, secret)


def parse(value: str | None) -> Session | None:
    """The session a cookie's value holds, None when it is absent or malformed."""
    sid, _, rest = (value or "").partition(".")
    tenant, _, secret = rest.partition(".")
    if not sid or not secret:
        return None
    return Session(sid, tenant or None, secret)


def of_scope(scope: Scope) -> Session | None:
    return parse(HTTPConnection(scope).cookies.get(COOKIE))


def credentials(scope: Scope) -> tuple[str | None, str | None]:
    """What the gate authenticates a console call with: the token's secret, and the tenant
    the session names (``wm.ops.gate.Browser.session``)."""
    found = of_scope(scope)
    return (None, None) if found is None else (found.secret, found.tenant)


def refuse(scope: Scope, reason: str) -> ASGIApp:
    """The gate's answer to a console call without a token in force: to the login page,
    which says why when a session was there but its token is no longer in force."""
    had_session = of_scope(scope) is not None
    response = RedirectResponse(LOGIN + ("?expired=1" if had_session else ""), 303)
    if had_session:
        forget(response)
    return response


def keep(response: Response, session: Session, *, secure: bool) -> None:
    response.set_cookie(
        COOKIE,
        session.cookie(),
        path=PREFIX,
        httponly=True,
        samesite="strict",
        secure=secure,
    )


def forget(response: Response) -> None:
    response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
