"""``wm api``, ``wm token …`` and ``wm audit``: the admin HTTP API, who may use it, and what
they did."""

from __future__ import annotations

import argparse
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from wm.cli.admin import component
from wm.cli.arguments import add_command, add_group, positive_int
from wm.cli.output import Context
from wm.store.access import Audit, Tokens
from wm.views import Role

if TYPE_CHECKING:
    from wm.cli.arguments import Commands

#: Audit entries ``wm audit`` shows unless told otherwise.
DEFAULT_AUDIT_LIMIT = 50


def register(commands: Commands, common: argparse.ArgumentParser) -> None:
    api = add_command(
        commands,
        "api",
        run_api,
        common,
        "serve the admin HTTP API (needs the [api] extra; README, Admin HTTP API)",
    )
    api.add_argument("--bind", help="address to listen on (default: $WM_API_BIND, 127.0.0.1)")
    api.add_argument("--port", type=int, help="port (default: $WM_API_PORT, 8080)")
    api.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate")
    api.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    api.add_argument(
        "--insecure",
        action="store_true",
        help="serve plain HTTP beyond loopback (only behind a TLS-terminating proxy)",
    )
    tokens = add_group(commands, "token", common, "create, list and revoke admin API tokens")
    create = add_command(
        tokens, "create", create_token, common, "create a token; its secret is printed once"
    )
    create.add_argument("--name", required=True, help="who or what uses it (unique in force)")
    create.add_argument(
        "--role",
        required=True,
        choices=[r.value for r in Role],
        help="viewer reads; operator also runs lifecycle, code, publish, replay; admin also "
        "deletes workers and purges dead letters",
    )
    create.add_argument(
        "--expires-days", type=positive_int, metavar="N", help="expire after N days (default never)"
    )
    listing = add_command(tokens, "list", list_tokens, common, "list tokens (never their secrets)")
    listing.add_argument("--all", action="store_true", help="include revoked tokens")
    revoke = add_command(tokens, "revoke", revoke_token, common, "revoke a token at once")
    revoke.add_argument("token", metavar="ID_OR_NAME")
    audit = add_command(
        commands, "audit", show_audit, common, "the admin API's mutating calls, newest last"
    )
    audit.add_argument("--token", metavar="ID_OR_NAME", help="only this token's calls")
    audit.add_argument(
        "--since", type=datetime.fromisoformat, metavar="TIME", help="ISO 8601, e.g. 2026-11-24"
    )
    audit.add_argument("--limit", type=positive_int, default=DEFAULT_AUDIT_LIMIT)


def run_api(ctx: Context, args: argparse.Namespace) -> int:
    changes = {
        "api_bind": args.bind,
        "api_port": args.port,
        "api_tls_cert": args.tls_cert,
        "api_tls_key": args.tls_key,
    }
    settings = ctx.settings.replace(**{k: v for k, v in changes.items() if v is not None})
    component("wm.ops.api", extra="api").serve(settings, insecure=args.insecure)
    return 0


def create_token(ctx: Context, args: argparse.Namespace) -> int:
    lifetime = timedelta(days=args.expires_days) if args.expires_days else None
    info, secret = Tokens(ctx.settings).create(args.name, args.role, expires_in=lifetime)
    if ctx.as_json:
        ctx.json({**info.to_json(), "token": secret})
        return 0
    ctx.fields(
        [
            ("id", info.id),
            ("name", info.name),
            ("role", info.role.value),
            ("expires", info.expires_at or "never"),
        ]
    )
    ctx.line(f"token: {secret}")
    ctx.line("(shown once: only its hash is stored)")
    return 0


def list_tokens(ctx: Context, args: argparse.Namespace) -> int:
    found = Tokens(ctx.settings).list(include_revoked=args.all)
    if ctx.as_json:
        ctx.json([t.to_json() for t in found])
        return 0
    ctx.table(
        ["ID", "NAME", "ROLE", "CREATED", "EXPIRES", "LAST USED", "REVOKED"],
        (
            [t.id, t.name, t.role.value, t.created_at, t.expires_at, t.last_used_at, t.revoked_at]
            for t in found
        ),
        empty="no tokens",
    )
    return 0


def revoke_token(ctx: Context, args: argparse.Namespace) -> int:
    info = Tokens(ctx.settings).revoke(args.token)
    if ctx.as_json:
        ctx.json(info.to_json())
    else:
        ctx.line(f"revoked token {info.id} ({info.name})")
    return 0


def show_audit(ctx: Context, args: argparse.Namespace) -> int:
    entries = Audit(ctx.settings).list(token=args.token, since=args.since, limit=args.limit)
    if ctx.as_json:
        ctx.json([e.to_json() for e in entries])
        return 0
    ctx.table(
        ["AT", "TOKEN", "ROLE", "FROM", "CALL", "STATUS", "RESULT"],
        (
            [
                e.at,
                e.token_name or "-",
                e.role or "-",
                e.remote,
                e.action or f"{e.method} {e.path}",
                e.status_code if e.status_code is not None else "unfinished",
                e.result,
            ]
            for e in entries
        ),
        empty="no audit entries",
    )
    return 0
