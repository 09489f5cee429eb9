"""``wm db …``, ``wm config``, and the commands other modules implement: ``wm up``, ``wm bench``."""

from __future__ import annotations

import argparse
import importlib
from typing import TYPE_CHECKING, Any

from kombu.utils.url import maybe_sanitize_url

from wm import store
from wm.cli.arguments import add_command, add_group
from wm.cli.output import Context
from wm.config import Settings, current_values, settings_table
from wm.errors import WorkManagerError

if TYPE_CHECKING:
    from wm.cli.arguments import Commands

#: Widest value ``wm config`` prints in its table; ``wm config --json`` shows them whole.
CONFIG_CELL_CHARS = 40


def register(commands: Commands, common: argparse.ArgumentParser) -> None:
    db = add_group(commands, "db", common, "migrate the worker store")
    add_command(db, "upgrade", db_upgrade, common, "apply every pending migration")
    add_command(db, "current", db_current, common, "print the current and the head revision")
    add_command(
        commands,
        "config",
        show_config,
        common,
        "print every setting: variable, default, current value, meaning",
    )
    up = add_command(
        commands,
        "up",
        run_up,
        common,
        "run the whole stack embedded on this machine (Redis, SQLite, a node)",
    )
    up.add_argument("--demo", action="store_true", help="also deploy a demo worker")
    up.add_argument(
        "--events",
        type=int,
        default=0,
        metavar="N",
        help="with --demo: stop after N demo events (default: run until Ctrl-C)",
    )
    up.add_argument(
        "--concurrency",
        type=int,
        default=2,
        metavar="N",
        help="Celery processes (or threads) of the node (default 2)",
    )
    up.add_argument(
        "--pool",
        choices=("prefork", "threads"),
        default="prefork",
        help="the node's Celery pool (default prefork; threads suit I/O-bound stub, native "
        "and .NET workers: README, Benchmarks, pool phase)",
    )
    health = add_command(
        commands,
        "health",
        show_health,
        common,
        "a node's health (exit 0 healthy, 1 degraded, 2 unhealthy)",
    )
    health.add_argument(
        "--node",
        metavar="URL",
        help="the node's health endpoint (default: http://127.0.0.1:$WM_HEALTH_PORT/health)",
    )
    # Everything after ``bench`` is the benchmark's own command line, options included.
    bench = commands.add_parser(
        "bench",
        add_help=False,
        prefix_chars="\x00",
        help="run the benchmarks (wm bench --help for theirs)",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(handler=run_bench, command_parser=bench)


def db_upgrade(ctx: Context, args: argparse.Namespace) -> int:
    store.upgrade(ctx.settings)
    revision = store.current_revision(ctx.settings)
    if ctx.as_json:
        ctx.json({"current": revision})
    else:
        ctx.line(f"database at revision {revision}")
    return 0


def db_current(ctx: Context, args: argparse.Namespace) -> int:
    current = store.current_revision(ctx.settings)
    head = store.head_revision(ctx.settings)
    if ctx.as_json:
        ctx.json({"current": current, "head": head, "up_to_date": current == head})
        return 0
    if current is None:
        state = "never migrated: run wm db upgrade"
    elif current == head:
        state = "up to date"
    else:
        state = "behind: run wm db upgrade"
    ctx.fields([("current", current), ("head", head), ("state", state)])
    return 0


def show_config(ctx: Context, args: argparse.Namespace) -> int:
    current = _current_values(ctx.settings)
    rows = [(env, default, current[env], meaning) for env, default, meaning in settings_table()]
    if ctx.as_json:
        ctx.json(
            [
                {"variable": env, "default": default, "current": value, "meaning": meaning}
                for env, default, value, meaning in rows
            ]
        )
        return 0
    ctx.table(
        ["VARIABLE", "DEFAULT", "CURRENT", "MEANING"],
        rows,
        empty="no settings",
        limit=CONFIG_CELL_CHARS,
    )
    return 0


def _current_values(settings: Settings) -> dict[str, str]:
    """Each variable's value in effect, shown like its default; passwords in URLs masked."""
    return {
        env: maybe_sanitize_url(shown) if "://" in shown else shown
        for env, shown in current_values(settings).items()
    }


#: ``wm health``'s exit code by status.
HEALTH_EXIT = {"healthy": 0, "degraded": 1, "unhealthy": 2}


def show_health(ctx: Context, args: argparse.Namespace) -> int:
    url = args.node
    if url is None:
        if not ctx.settings.health_port:
            raise WorkManagerError(
                "no node to ask: pass --node URL, or set WM_HEALTH_PORT to a local node's port"
            )
        url = f"http://127.0.0.1:{ctx.settings.health_port}/health"
    _, found = component("wm.ops.health").fetch(url)
    status = str(found.get("status", "unhealthy"))
    if ctx.as_json:
        ctx.json(found)
    else:
        checks = found.get("checks", {})
        ctx.fields(
            [
                ("node", found.get("node")),
                ("status", status),
                *[
                    (name, "ok" if check["ok"] else f"FAILED: {check.get('error')}")
                    for name, check in checks.items()
                ],
                ("recovery", found.get("recovery", {}).get("state")),
                ("consuming", "yes" if found.get("consuming") else "no"),
                *[
                    (mime_type, _facts(facts))
                    for mime_type, facts in found.get("engines", {}).items()
                ],
            ]
        )
        for reason in found.get("reasons", []):
            ctx.line(f"- {reason}")
    return HEALTH_EXIT.get(status, 2)


def _facts(facts: dict[str, Any]) -> str:
    """``sandbox layers: user namespace, …; sandbox missing: none`` for one engine."""
    shown = (
        f"{key.replace('_', ' ')}: {', '.join(map(str, value)) or 'none'}"
        if isinstance(value, list)
        else f"{key.replace('_', ' ')}: {value}"
        for key, value in facts.items()
    )
    return "; ".join(shown)


def run_up(ctx: Context, args: argparse.Namespace) -> int:
    return int(
        component("wm.local.up").run(
            demo=args.demo, events=args.events, concurrency=args.concurrency, pool=args.pool
        )
    )


def run_bench(ctx: Context, args: argparse.Namespace) -> int:
    return int(component("wm.local.bench").main(list(args.bench_args)))


def component(name: str, *, extra: str | None = None) -> Any:
    """Imported only when its command runs: it needs what no other command loads (and, with
    ``extra``, what only that extra of the package installs)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            raise WorkManagerError(f"{name} is missing from this installation") from exc
        if extra is None:
            raise
        raise WorkManagerError(
            f"{name} needs the [{extra}] extra (module {exc.name!r} is missing): "
            f"pip install 'workmanager[{extra}]'"
        ) from exc
