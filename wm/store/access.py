"""The statements behind the admin HTTP API's bearer tokens and its audit log
(``wm.control.access`` holds the rules: token format, roles, expiry, tenants). Only the
SHA-256 of a token is stored."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from wm.errors import InvalidArgument
from wm.store.models import ApiToken, AuditEntry
from wm.store.records import by_prefix
from wm.views import AuditInfo, Role, TokenInfo, aware

#: ``api_tokens.tenant`` of a deployment-wide token: no tenant name matches it
#: (``wm.names.TENANT_PATTERN``), so it never meets a real tenant, and the column stays
#: NOT NULL as revision 0005 made it.
ALL_TENANTS = "*"


def _token_info(row: ApiToken) -> TokenInfo:
    return TokenInfo(
        row.id,
        row.name,
        Role(row.role),
        aware(row.created_at),
        aware(row.expires_at),
        aware(row.last_used_at),
        aware(row.revoked_at),
        None if row.tenant == ALL_TENANTS else row.tenant,
    )


# -- tokens ----------------------------------------------------------------------------------


def insert_token(
    session: Session,
    token_id: str,
    name: str,
    role: Role,
    secret_sha256: str,
    *,
    tenant: str | None,
    created_at: datetime,
    expires_at: datetime | None,
) -> TokenInfo:
    """A new token in force, of ``tenant`` (None: deployment-wide); :class:`InvalidArgument`
    if one named ``name`` is in force."""
    taken = InvalidArgument(f"a token named {name!r} is in force; revoke it first")
    if _in_force(session, name) is not None:
        raise taken
    row = ApiToken(
        id=token_id,
        tenant=ALL_TENANTS if tenant is None else tenant,
        name=name,
        role=role.value,
        secret_sha256=secret_sha256,
        created_at=created_at,
        expires_at=expires_at,
    )
    session.add(row)
    try:
        session.flush()
    except IntegrityError:  # the same name, created meanwhile
        raise taken from None
    return _token_info(row)


def tokens(
    session: Session, *, include_revoked: bool, tenant: str | None = None
) -> list[TokenInfo]:
    """Tokens (in force, unless ``include_revoked``; of ``tenant`` alone when given, without
    the deployment-wide ones), oldest first."""
    query = select(ApiToken).order_by(ApiToken.created_at, ApiToken.id)
    if not include_revoked:
        query = query.where(ApiToken.revoked_at.is_(None))
    if tenant is not None:
        query = query.where(ApiToken.tenant == tenant)
    return [_token_info(row) for row in session.scalars(query).all()]


def revoke(
    session: Session, reference: str, at: datetime, tenant: str | None = None
) -> TokenInfo | None:
    """Revoke the token in force with this id, name or short id (of ``tenant`` alone when
    given: another's is not found); None if there is none."""
    row = session.get(ApiToken, reference)
    if row is None or row.revoked_at is not None:
        row = _in_force(session, reference, tenant)
    if row is None:
        mine: list[ColumnElement[bool]] = [ApiToken.revoked_at.is_(None)]
        if tenant is not None:
            mine.append(ApiToken.tenant == tenant)
        full = by_prefix(session, ApiToken.id, reference, "token", *mine)
        row = None if full is None else session.get(ApiToken, full)
    if row is None or (tenant is not None and row.tenant != tenant):
        return None
    row.revoked_at = at
    session.flush()
    return _token_info(row)


def token(session: Session, token_id: str) -> tuple[TokenInfo, str] | None:
    """The token with this id and its stored SHA-256, or None."""
    row = session.get(ApiToken, token_id)
    return None if row is None else (_token_info(row), row.secret_sha256)


def touch(session: Session, token_id: str, at: datetime) -> None:
    """Record the token's use at ``at``."""
    session.execute(update(ApiToken).where(ApiToken.id == token_id).values(last_used_at=at))


def _in_force(session: Session, name: str, tenant: str | None = None) -> ApiToken | None:
    query = select(ApiToken).where(ApiToken.name == name, ApiToken.revoked_at.is_(None))
    if tenant is not None:
        query = query.where(ApiToken.tenant == tenant)
    found: ApiToken | None = session.scalar(query)
    return found


# -- the audit log ---------------------------------------------------------------------------


def begin_entry(
    session: Session, at: datetime, method: str, path: str, remote: str | None, tenant: str
) -> int:
    """A new audit entry of a call working in ``tenant``; returns its id."""
    row = AuditEntry(at=at, method=method, path=path, remote=remote, tenant=tenant)
    session.add(row)
    session.flush()
    return int(row.id)


def finish_entry(
    session: Session,
    entry_id: int,
    *,
    token: TokenInfo | None,
    action: str | None,
    status_code: int,
    result: str,
    duration_ms: float,
) -> None:
    """Complete an entry with who called and what came of it."""
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


def entries(
    session: Session,
    *,
    token: str | None,
    since: datetime | None,
    limit: int,
    tenant: str | None = None,
) -> list[AuditInfo]:
    """The newest ``limit`` entries (by ``token`` id or name, at or after ``since``, of calls
    that worked in ``tenant`` unless it is None), oldest first."""
    query = select(AuditEntry)
    if tenant is not None:
        query = query.where(AuditEntry.tenant == tenant)
    if token is not None:
        query = query.where((AuditEntry.token_id == token) | (AuditEntry.token_name == token))
    if since is not None:
        query = query.where(AuditEntry.at >= since)
    rows = session.scalars(query.order_by(AuditEntry.id.desc()).limit(limit)).all()
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
            r.tenant,
        )
        for r in reversed(rows)
    ]
