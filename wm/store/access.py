"""Who may use the admin HTTP API, and what they did with it: bearer tokens and the audit log.

A token reads ``wm_<id>_<secret>``: the id is public (it names the token in ``wm token list``
and the audit log), the secret is 256 random bits shown once at creation. Only the SHA-256 of
the whole token is stored; a high-entropy secret needs no slow hash (the way GitHub and
PyPI store theirs), so checking one costs one indexed read and a constant-time compare.

Roles are ordered: a *viewer* reads, an *operator* also runs lifecycle, code, publish and
replay, an *admin* also deletes workers and purges dead letters.
"""

from __future__ import annotations

import builtins
import hashlib
import hmac
import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from wm.config import Settings
from wm.errors import InvalidArgument, TokenNotFound
from wm.names import check_name
from wm.store.db import session_scope
from wm.store.models import ApiToken, AuditEntry
from wm.store.records import by_prefix
from wm.views import AuditInfo, Role, TokenInfo, aware

#: A token's last use is written at most this often (each request would otherwise write).
LAST_USED_RESOLUTION = timedelta(minutes=1)
_PREFIX = "wm"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _token_info(row: ApiToken) -> TokenInfo:
    return TokenInfo(
        row.id,
        row.name,
        Role(row.role),
        aware(row.created_at),
        aware(row.expires_at),
        aware(row.last_used_at),
        aware(row.revoked_at),
    )


class Tokens:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def create(
        self, name: str, role: Role | str, *, expires_in: timedelta | None = None
    ) -> tuple[TokenInfo, str]:
        """A new token in force; returns it and its secret text, which is never shown again."""
        check_name("token name", name)
        try:
            role = Role(role)
        except ValueError:
            raise InvalidArgument(
                f"role {role!r} is unknown: expected one of {', '.join(Role)}"
            ) from None
        if expires_in is not None and expires_in <= timedelta(0):
            raise InvalidArgument("a token's lifetime must be positive")
        token_id = secrets.token_hex(6)
        text = f"{_PREFIX}_{token_id}_{secrets.token_urlsafe(32)}"
        now = datetime.now(UTC)
        with session_scope(self.settings) as session:
            if self._in_force(session, name) is not None:
                raise InvalidArgument(f"a token named {name!r} is in force; revoke it first")
            row = ApiToken(
                id=token_id,
                name=name,
                role=role.value,
                secret_sha256=_digest(text),
                created_at=now,
                expires_at=now + expires_in if expires_in is not None else None,
            )
            session.add(row)
            try:
                session.flush()
            except IntegrityError:
                raise InvalidArgument(
                    f"a token named {name!r} is in force; revoke it first"
                ) from None
            return _token_info(row), text

    def list(self, *, include_revoked: bool = False) -> builtins.list[TokenInfo]:
        query = select(ApiToken).order_by(ApiToken.created_at, ApiToken.id)
        if not include_revoked:
            query = query.where(ApiToken.revoked_at.is_(None))
        with session_scope(self.settings) as session:
            return [_token_info(row) for row in session.scalars(query).all()]

    def revoke(self, reference: str) -> TokenInfo:
        """Revoke the token in force with this id or name; it stops working at once."""
        with session_scope(self.settings) as session:
            row = session.get(ApiToken, reference)
            if row is None or row.revoked_at is not None:
                row = self._in_force(session, reference)
            if row is None:
                full = by_prefix(
                    session, ApiToken.id, reference, "token", ApiToken.revoked_at.is_(None)
                )
                row = None if full is None else session.get(ApiToken, full)
            if row is None:
                raise TokenNotFound(f"no token in force with id, short id or name {reference!r}")
            row.revoked_at = datetime.now(UTC)
            session.flush()
            return _token_info(row)

    def authenticate(self, text: str) -> TokenInfo | None:
        """The token in force whose secret is ``text``, or None (unknown, revoked, expired)."""
        parts = text.split("_", 2)  # the secret may hold "_" itself
        if len(parts) != 3 or parts[0] != _PREFIX:
            return None
        now = datetime.now(UTC)
        with session_scope(self.settings) as session:
            row = session.get(ApiToken, parts[1])
            if row is None or not hmac.compare_digest(row.secret_sha256, _digest(text)):
                return None
            info = _token_info(row)
            if info.revoked_at is not None or (
                info.expires_at is not None and info.expires_at <= now
            ):
                return None
            if info.last_used_at is None or now - info.last_used_at >= LAST_USED_RESOLUTION:
                session.execute(
                    update(ApiToken).where(ApiToken.id == row.id).values(last_used_at=now)
                )
            return info

    @staticmethod
    def _in_force(session: Any, name: str) -> ApiToken | None:
        found: ApiToken | None = session.scalar(
            select(ApiToken).where(ApiToken.name == name, ApiToken.revoked_at.is_(None))
        )
        return found


class Audit:
    """The audit log: an entry is begun before a mutating call runs and finished after it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def begin(self, method: str, path: str, remote: str | None) -> int:
        with session_scope(self.settings) as session:
            row = AuditEntry(at=datetime.now(UTC), method=method, path=path, remote=remote)
            session.add(row)
            session.flush()
            return int(row.id)

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
            session.execute(
                update(AuditEntry)
                .where(AuditEntry.id == entry_id)
                .values(
                    token_id=token.id if token else None,
                    token_name=token.name if token else None,
                    role=token.role.value if token else None,
                    action=action,
                    status_code=status_code,
                    result=result,
                    duration_ms=duration_ms,
                )
            )

    def list(
        self,
        *,
        token: str | None = None,
        since: datetime | None = None,
        limit: int = 100,
    ) -> builtins.list[AuditInfo]:
        """The newest ``limit`` entries (by ``token`` id or name, at or after ``since``),
        oldest first."""
        query = select(AuditEntry)
        if token is not None:
            query = query.where((AuditEntry.token_id == token) | (AuditEntry.token_name == token))
        if since is not None:
            query = query.where(AuditEntry.at >= since)
        query = query.order_by(AuditEntry.id.desc()).limit(limit)
        with session_scope(self.settings) as session:
            rows = session.scalars(query).all()
            return [
                AuditInfo(
                    r.id,
                    aware(r.at),
                    r.token_id,
                    r.token_name,
                    r.role,
                    r.remote,
                    r.method,
                    r.path,
                    r.action,
                    r.status_code,
                    r.result,
                    r.duration_ms,
                )
                for r in reversed(rows)
            ]
