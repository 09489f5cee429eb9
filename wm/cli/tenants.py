"""``wm tenant …``: create, list and delete tenants, set their limits (docs/guides/tenants.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from wm.cli.arguments import Group, pass_output
from wm.cli.output import Output
from wm.tenantlimits import NAMES, TenantLimits, parse_limit
from wm.views import TenantInfo

#: Each limit's option and help.
_OPTIONS = {
    "max_concurrency": "deliveries of the tenant running at once across the cluster",
    "rate_limit": "deliveries begun per second across the cluster (events/s)",
    "max_workers": "live workers of the tenant",
}


def limit_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--max-concurrency``, ``--rate-limit``, ``--max-workers``: a value, or ``none``."""
    for name in reversed(NAMES):
        flag = "--" + name.replace("_", "-")
        metavar = "R" if name == "rate_limit" else "N"
        text = f"Limit: {_OPTIONS[name]}; 'none' is unlimited (the default)."
        command = click.option(flag, name, metavar=metavar, default=None, help=text)(command)
    return command


def _given(options: dict[str, str | None]) -> dict[str, int | float | None]:
    return {name: parse_limit(name, text) for name, text in options.items() if text is not None}


@click.group(cls=Group)
def tenant() -> None:
    """Create, list and delete tenants, and set their limits."""


@tenant.command("create")
@click.argument("name")
@limit_options
@pass_output
def create_tenant(out: Output, name: str, **limits: str | None) -> int:
    """Create tenant NAME (1-63 of a-z, 0-9 and -, starting with a letter or digit)."""
    from wm.control import tenants

    info = tenants.create(out.store_settings, name, _given(limits))
    if out.as_json:
        out.json(info.to_json())
    else:
        out.line(f"created tenant {info.name}{_limits_line(info.limits)}")
    return 0


@tenant.command("set")
@click.argument("name")
@limit_options
@pass_output
def set_limits(out: Output, name: str, **limits: str | None) -> int:
    """Set limits of tenant NAME; those not given are kept."""
    from wm.control import tenants

    info = tenants.set_limits(out.store_settings, name, _given(limits))
    if out.as_json:
        out.json(info.to_json())
    else:
        out.line(f"tenant {info.name}{_limits_line(info.limits)}")
    return 0


def _limits_line(limits: TenantLimits) -> str:
    return ": " + ", ".join(f"{name} {limits.shown(name)}" for name in NAMES)


@tenant.command("list")
@pass_output
def list_tenants(out: Output) -> int:
    """List tenants by name, with their live workers and limits ('-': unlimited)."""
    if out.remote:
        found = out.remote.list_tenants()
    else:  # not through WorkManager, which checks the tenant WM_TENANT names
        from wm.control import tenants

        found = tenants.listing(out.store_settings)
    if out.as_json:
        out.json([t.to_json() for t in found])
        return 0
    out.table(
        ["NAME", "WORKERS", "MAX_CONCURRENCY", "RATE_LIMIT", "MAX_WORKERS", "CREATED"],
        (_row(t) for t in found),
        empty="no tenants",
    )
    return 0


@tenant.command("delete")
@click.argument("name")
@pass_output
def delete_tenant(out: Output, name: str) -> int:
    """Delete tenant NAME: refused while it has live workers, subscriptions or tokens in
    force (each is named); the default tenant is never deleted."""
    from wm.control import tenants

    tenants.delete(out.store_settings, name)
    if out.as_json:
        out.json({"deleted": name})
    else:
        out.line(f"deleted tenant {name}")
    return 0


def _row(info: TenantInfo) -> list[Any]:
    shown = [info.limits.shown(name) for name in NAMES]
    return [info.name, info.workers, *shown, info.created_at]
