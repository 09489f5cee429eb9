"""Who may use the admin HTTP API, and what they did with it: bearer tokens and the audit log.

A token reads ``wm_<id>_<secret>``: the id is public (it names the token in ``wm token list``
and the audit log), the secret is 256 random bits shown once at creation. Only the SHA-256 of
the whole token is stored; a high-entropy secret needs no slow hash (the way GitHub and
PyPI store theirs), so checking one costs one indexed read and a constant-time compare.

Roles are ordered: a *viewer* reads, an *operator* also runs lifecycle, code, publish and
replay, an *admin* also deletes workers and purges dead letters.

A token belongs to one tenant, and every call it makes works in that tenant alone: another
tenant's objects are not found, exactly as missing ones. Only an admin token may instead be
*deployment-wide* (``--all-tenants``): it names the tenant of each call (the ``WM-Tenant``
header, the default tenant without one). A
deployment-wide token crosses the one boundary tenants exist for, so it is kept to the role
that already holds every power inside a tenant: the credentials that cross tenants are then
few, all admins', and listed as such by ``wm token list`` (a viewer or operator that needs
several tenants gets one token in each, which each tenant can revoke).

Tokens created before tenants existed are tokens of the default tenant (revision 0005 put
every row there). A single-tenant deployment never names a tenant: everything it has is in
the default tenant, so those tokens do everything they did; what they cannot do, reach a
tenant created later, never existed for them. A deployment that takes on
tenants makes its cross-tenant admin token on purpose: ``wm token create --all-tenants``.
"""

from __future__ import annotations

import builtins
import hashlib
import hmac
import secrets
from datetime import UTC, datetime, timedelta

from wm.config import Settings
from wm.control import tenants
from wm.errors import InvalidArgument, TokenNotFound
from wm.names import DEFAULT_TENANT, check_name
from wm.store import access
from wm.store.db import session_scope
from wm.views import AuditInfo, Role, TokenInfo

#: A token's last use is written at most this often (each request would otherwise write).
LAST_USED_RESOLUTION = timedelta(minutes=1)
_PREFIX = "wm"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _role(role: Role | str) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise InvalidArgument(
            f"role {role!r} is unknown: expected one of {', '.join(Role)}"
        ) from None


class Tokens:
    """Tokens, created by default in ``tenant`` (default: WM_TENANT, or the default tenant)."""

    def __init__(self, settings: Settings, tenant: str | None = None) -> None:
        self.settings = settings
        self.tenant = settings.tenant if tenant is None else tenant

    def create(
        self,
        name: str,
        role: Role | str,
        *,
        expires_in: timedelta | None = None,
        tenant: str | None = None,
        all_tenants: bool = False,
    ) -> tuple[TokenInfo, str]:
        """A new token in force, of ``tenant`` (default: this object's), or deployment-wide
        with ``all_tenants`` (admins only); returns it and its secret text, which is never
        shown again. A tenant that does not exist is refused (:class:`TenantNotFound`)."""
        check_name("token name", name)
        role = _role(role)
        if expires_in is not None and expires_in <= timedelta(0):
            raise InvalidArgument("a token's lifetime must be positive")
        scope = self._scope(role, tenant, all_tenants)
        token_id = secrets.token_hex(6)
        text = f"{_PREFIX}_{token_id}_{secrets.token_urlsafe(32)}"
        now = datetime.now(UTC)
        expires_at = now + expires_in if expires_in is not None else None
        with session_scope(self.settings) as session:
            info = access.insert_token(
                session,
                token_id,
                name,
                role,
                _digest(text),
                tenant=scope,
                created_at=now,
                expires_at=expires_at,
            )
        return info, text

    def _scope(self, role: Role, tenant: str | None, all_tenants: bool) -> str | None:
        """The tenant a new token works in, None for a deployment-wide one."""
        if not all_tenants:
            return tenants.checked(self.settings, self.tenant if tenant is None else tenant)
        if tenant is not None:
            raise InvalidArgument(
                f"a token works in one tenant ({tenant!r}) or in all of them, not both"
            )
        if role != Role.ADMIN:
            raise InvalidArgument(
                f"only an admin token may work in all tenants, not a {role.value} one: "
                "give it a tenant (--tenant), one token per tenant it needs"
            )
        return None

    def list(
        self, *, include_revoked: bool = False, own_tenant: bool = False
    ) -> builtins.list[TokenInfo]:
        """Every token (``own_tenant``: this object's tenant's alone, as the API shows a
        tenant's admin), oldest first."""
        with session_scope(self.settings) as session:
            return access.tokens(
                session, include_revoked=include_revoked, tenant=self._own(own_tenant)
            )

    def revoke(self, reference: str, *, own_tenant: bool = False) -> TokenInfo:
        """Revoke the token in force with this id or name (``own_tenant``: of this object's
        tenant, another's is not found); it stops working at once."""
        with session_scope(self.settings) as session:
            revoked = access.revoke(
                session, reference, datetime.now(UTC), tenant=self._own(own_tenant)
            )
        if revoked is None:
            raise TokenNotFound(f"no token in force with id, short id or name {reference!r}")
        return revoked

    def _own(self, own_tenant: bool) -> str | None:
        return self.tenant if own_tenant else None

    def authenticate(self, text: str) -> TokenInfo | None:
        """The token in force whose secret is ``text``, or None (unknown, revoked, expired)."""
        parts = text.split("_", 2)  # the secret may hold "_" itself
        if len(parts) != 3 or parts[0] != _PREFIX:
            return None
        now = datetime.now(UTC)
        with session_scope(self.settings) as session:
            found = access.token(session, parts[1])
            if found is None or not hmac.compare_digest(found[1], _digest(text)):
                return None
            info = found[0]
            if info.revoked_at is not None or (
                info.expires_at is not None and info.expires_at <= now
            ):
                return None
            if info.last_used_at is None or now - info.last_used_at >= LAST_USED_RESOLUTION:
                access.touch(session, info.id, now)
            return info


class Audit:
    """The audit log: an entry is begun before a mutating call runs and finished after it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def begin(
        self, method: str, path: str, remote: str | None, tenant: str = DEFAULT_TENANT
    ) -> int:
        """A new entry of a call that works in ``tenant``; returns its id."""
        with session_scope(self.settings) as session:
            return access.begin_entry(session, datetime.now(UTC), method, path, remote, tenant)

    def finish(
        self,
        entry_id: int,
        *,
        token: TokenInfo | None,
        action: str | None,
        status_code: int,
        result: str,
        duration_ms: float,
    ) -> None:
        with session_scope(self.settings) as session:
            access.finish_entry(
                session,
                entry_id,
                token=token,
                action=action,
                status_code=status_code,
                result=result,
                duration_ms=duration_ms,
            )

    def list(
        self,
        *,
        token: str | None = None,
        since: datetime | None = None,
        limit: int = 100,
        tenant: str | None = None,
    ) -> builtins.list[AuditInfo]:
        """The newest ``limit`` entries (by ``token`` id or name, at or after ``since``, of
        calls that worked in ``tenant``; every tenant's when None), oldest first."""
        with session_scope(self.settings) as session:
            return access.entries(session, token=token, since=since, limit=limit, tenant=tenant)
