"""``wm api``, ``wm token …`` and ``wm audit``: the admin HTTP API, who may use it, and what
they did."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import click

from wm.cli.admin import component
from wm.cli.arguments import (
    POSITIVE_INT,
    Command,
    Group,
    UsageError,
    iso_time,
    pass_output,
)
from wm.cli.output import Output, labelled
from wm.views import Role

if TYPE_CHECKING:
    from wm.views import AuditInfo, TokenInfo

#: How ``wm token list`` shows a deployment-wide token's tenant.
ALL_TENANTS = "*"

#: Audit entries ``wm audit`` shows unless told otherwise.
DEFAULT_AUDIT_LIMIT = 50
#: Highest TCP port number.
MAX_PORT = 65535
#: A worker id in an audited call (``… ref=3f2a…``): shown with the worker's name beside it.
WORKER_REF = re.compile(r"\bref=([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\b")


@click.command()
@click.option(
    "--bind",
    metavar="ADDRESS",
    help="Address to listen on. [default: $WM_API_BIND, 127.0.0.1]",
)
@click.option(
    "--port",
    type=click.IntRange(1, MAX_PORT),
    metavar="PORT",
    help="Port to listen on. [default: $WM_API_PORT, 8080]",
)
@click.option(
    "--tls-cert",
    metavar="PEM",
    help="Serve HTTPS with this certificate. [default: $WM_API_TLS_CERT]",
)
@click.option(
    "--tls-key",
    metavar="PEM",
    help="The certificate's private key. [default: $WM_API_TLS_KEY]",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="Serve plain HTTP beyond loopback (only behind a TLS-terminating proxy).",
)
@pass_output
def api(
    out: Output,
    bind: str | None,
    port: int | None,
    tls_cert: str | None,
    tls_key: str | None,
    insecure: bool,
) -> int:
    """Serve the admin HTTP API until Ctrl-C (needs the [api] extra).

    See docs/guides/admin-api.md. It prints no JSON: for JSON log lines, set WM_LOG_FORMAT=json.
    """
    if out.as_json:
        raise UsageError("wm api prints no JSON; for JSON log lines set WM_LOG_FORMAT=json")
    changes = {"api_bind": bind, "api_port": port, "api_tls_cert": tls_cert, "api_tls_key": tls_key}
    settings = out.store_settings.replace(**{k: v for k, v in changes.items() if v is not None})
    component("wm.ops.api", extra="api").serve(settings, insecure=insecure)
    return 0


@click.group(cls=Group)
def token() -> None:
    """Create, list and revoke admin API tokens."""


@token.command("create")
@click.option("--name", required=True, help="Who or what uses it (unique among tokens in force).")
@click.option(
    "--role",
    required=True,
    type=click.Choice([r.value for r in Role]),
    help="Viewer reads; operator also runs lifecycle, code, publish, replay; admin also "
    "deletes workers and purges dead letters.",
)
@click.option(
    "--expires-days",
    type=POSITIVE_INT,
    metavar="N",
    help="Expire after N days. [default: never]",
)
@click.option(
    "--all-tenants",
    is_flag=True,
    help="Deployment-wide (admins only): names any tenant with WM-Tenant, manages tenants. "
    "[default: the tenant of --tenant]",
)
@pass_output
def create_token(
    out: Output, name: str, role: str, expires_days: int | None, all_tenants: bool
) -> int:
    """Create a token of the tenant (--tenant), or of all tenants; its secret is printed
    once."""
    lifetime = timedelta(days=expires_days) if expires_days else None
    info, secret = out.manager.tokens.create(
        name, role, expires_in=lifetime, tenant=out.tenant, all_tenants=all_tenants
    )
    if out.as_json:
        out.json({**info.to_json(), "token": secret})
        return 0
    out.fields(
        [
            ("id", info.id),
            ("name", info.name),
            ("role", info.role.value),
            ("tenant", _tenant(info)),
            ("expires", info.expires_at or "never"),
            ("token", secret),
        ]
    )
    out.note("The token is shown once: only its hash is stored.")
    return 0


@token.command("list")
@click.option("--all", "include_revoked", is_flag=True, help="Include revoked tokens.")
@pass_output
def list_tokens(out: Output, include_revoked: bool) -> int:
    """List every tenant's tokens, oldest first (never their secrets); a deployment-wide
    one's tenant is *."""
    found = out.reader.tokens.list(include_revoked=include_revoked)
    if out.as_json:
        out.json([t.to_json() for t in found])
        return 0
    out.table(
        ["ID", "NAME", "ROLE", "TENANT", "CREATED", "EXPIRES", "LAST USED", "REVOKED"],
        (
            [
                t.id,
                t.name,
                t.role.value,
                _tenant(t),
                t.created_at,
                t.expires_at,
                t.last_used_at,
                t.revoked_at,
            ]
            for t in found
        ),
        empty="no tokens",
    )
    return 0


def _tenant(token: TokenInfo) -> str:
    return ALL_TENANTS if token.tenant is None else token.tenant


@token.command("revoke")
@click.argument("reference", metavar="ID_OR_NAME")
@pass_output
def revoke_token(out: Output, reference: str) -> int:
    """Revoke a token at once."""
    info = out.manager.tokens.revoke(reference)
    if out.as_json:
        out.json(info.to_json())
    else:
        out.line(f"revoked token {labelled(info.id, info.name)}")
    return 0


@click.command(cls=Command)
@click.option("--token", "reference", metavar="ID_OR_NAME", help="Only this token's calls.")
@click.option(
    "--since",
    metavar="TIME",
    callback=iso_time,
    help="Only calls at or after this time (ISO 8601).",
)
@click.option(
    "--limit",
    type=POSITIVE_INT,
    default=DEFAULT_AUDIT_LIMIT,
    metavar="N",
    help="Show the newest N calls.",
)
@pass_output
def audit(out: Output, reference: str | None, since: datetime | None, limit: int) -> int:
    """The admin API's mutating calls, newest last."""
    entries = out.reader.audit.list(token=reference, since=since, limit=limit)
    if out.as_json:
        out.json([e.to_json() for e in entries])
        return 0
    names = out.reader.worker_names(  # the command line's audit log is every tenant's
        {m for e in entries for m in WORKER_REF.findall(e.action or "")}, all_tenants=True
    )
    out.table(
        ["AT", "TOKEN", "ROLE", "FROM", "CALL", "STATUS", "RESULT"],
        (_audit_row(e, names) for e in entries),
        empty="no audit entries",
        wrap=("TOKEN", "CALL"),
    )
    return 0


def _audit_row(e: AuditInfo, names: dict[str, str | None]) -> list[Any]:
    def named(found: re.Match[str]) -> str:
        return f"ref={labelled(found[1], names.get(found[1]))}"

    return [
        e.at,
        labelled(e.token_id, e.token_name),
        e.role,
        e.remote,
        WORKER_REF.sub(named, e.action) if e.action else f"{e.method} {e.path}",
        e.status_code if e.status_code is not None else "unfinished",
        e.result,
    ]
