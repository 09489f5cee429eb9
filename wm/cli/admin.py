"""``wm db …``, ``wm config``, ``wm recover``, ``wm health``, ``wm completion``, and the
commands other modules implement: ``wm up``, ``wm bench``."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

from wm.cli.arguments import POSITIVE_INT, Command, Group, pass_output
from wm.cli.output import Output
from wm.config import (
    SECRET,
    current_values,
    deployment_name,
    masked,
    misspelt,
    settings_table,
)
from wm.errors import InvalidArgument, MissingDependency, WorkManagerError
from wm.extras import install_hint

#: Narrowest a DEFAULT, CURRENT or MEANING cell of ``wm config`` gets before the VARIABLE
#: column folds too, and the space between two columns of a table.
CONFIG_MIN_CELL_CHARS = 20
COLUMN_GAP_CHARS = 3
#: ``wm health``'s exit code by status; anything else counts as unhealthy.
HEALTH_EXIT = {"healthy": 0, "degraded": 1, "unhealthy": 2}
UNHEALTHY_EXIT = HEALTH_EXIT["unhealthy"]
#: ``wm health`` could not ask a node (none named, none answered): the monitoring plugins'
#: UNKNOWN, apart from a node that answered "unhealthy".
UNKNOWN_EXIT = 3
#: Shells ``wm completion`` writes a script for (click's own completion classes).
SHELLS = ("bash", "zsh", "fish")
#: The program name and the variable the completion scripts call ``wm`` with: click's
#: convention for a program named ``wm``.
PROG_NAME = "wm"
COMPLETE_VAR = "_WM_COMPLETE"


# -- wm db ---------------------------------------------------------------------------------------


@click.group(cls=Group)
def db() -> None:
    """Migrate the worker store (WM_DATABASE_URL)."""


@db.command("upgrade")
@pass_output
def db_upgrade(out: Output) -> int:
    """Apply every pending migration."""
    from wm import store

    store.upgrade(out.store_settings)
    revision = store.current_revision(out.store_settings)
    if out.as_json:
        out.json({"current": revision})
    else:
        out.line(f"database at revision {revision}")
    return 0


@db.command("current")
@pass_output
def db_current(out: Output) -> int:
    """Print the current and the head revision (through the admin API when WM_API_URL is
    set: the head of the API's code)."""
    if out.remote:  # not out.reader: a WorkManager needs a migrated database
        current, head = out.remote.revisions()
    else:
        from wm import store

        current = store.current_revision(out.settings)
        head = store.head_revision(out.settings)
    if out.as_json:
        out.json({"current": current, "head": head, "up_to_date": current == head})
        return 0
    if current is None:
        state = "never migrated: run wm db upgrade"
    elif current == head:
        state = "up to date"
    else:
        state = "behind: run wm db upgrade"
    out.fields([("current", current), ("head", head), ("state", state)])
    return 0


# -- wm config -----------------------------------------------------------------------------------


@click.command(cls=Command)
@pass_output
def config(out: Output) -> int:
    """Print every setting: variable, default, current value, meaning.

    Passwords in URLs are masked.
    """
    current = _current_values(out)
    for warning in misspelt():
        print(f"wm: warning: {warning}", file=sys.stderr)
    rows = [(env, default, current[env], meaning) for env, default, meaning in settings_table()]
    if out.as_json:
        out.json(
            [
                {"variable": env, "default": default, "current": value, "meaning": meaning}
                for env, default, value, meaning in rows
            ]
        )
        return 0
    out.table(
        ["VARIABLE", "DEFAULT", "CURRENT", "MEANING"],
        rows,
        empty="no settings",
        wrap=_config_wrap(out, [env for env, *_ in rows]),
    )
    return 0


def _config_wrap(out: Output, variables: list[str]) -> tuple[str, ...]:
    """The columns that wrap: the variable's name stays whole while the three others keep
    ``CONFIG_MIN_CELL_CHARS`` each; on a narrower terminal it folds like them."""
    others = 3  # DEFAULT, CURRENT, MEANING
    whole = max(map(len, variables)) + others * (CONFIG_MIN_CELL_CHARS + COLUMN_GAP_CHARS)
    return (
        ("DEFAULT", "CURRENT") if out.console.width >= whole else ("VARIABLE", "DEFAULT", "CURRENT")
    )


def _current_values(out: Output) -> dict[str, str]:
    """Each variable's value in effect, shown like its default; passwords in URLs and
    secrets masked; the deployment's name also when it is derived."""
    values = {
        env: "**" if env in SECRET and shown else masked(shown) if "://" in shown else shown
        for env, shown in current_values(out.settings).items()
    }
    if not out.settings.deployment:
        values["WM_DEPLOYMENT"] = f"({deployment_name(out.settings)})"
    return values


# -- wm up ---------------------------------------------------------------------------------------


@click.command(cls=Command)
@click.option("--demo", is_flag=True, help="Also deploy a demo worker and send it events.")
@click.option(
    "--events",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="With --demo: stop after N demo events (0 runs until Ctrl-C).",
)
@click.option(
    "--concurrency",
    type=POSITIVE_INT,
    default=2,
    metavar="N",
    help="Celery processes (or threads) of each node.",
)
@click.option(
    "--pool",
    type=click.Choice(("prefork", "threads")),
    default="prefork",
    help="The node's Celery pool; threads suit I/O-bound stub, native and .NET workers "
    "(docs/benchmarks.md, pool phase).",
)
@click.option(
    "--nodes",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Celery nodes; 0: one prefork node per --concurrency cores (a node's main process "
    "caps it at about 1,000 events/s, docs/guides/nodes.md, Nodes and cores).",
)
@pass_output
def up(out: Output, demo: bool, events: int, concurrency: int, pool: str, nodes: int) -> int:
    """Run the whole stack embedded on this machine (Redis, SQLite, nodes).

    Runs in the foreground until Ctrl-C. With --json it prints one JSON object, the
    environment it wrote, once the system is up.
    """
    return int(
        component("wm.local.up").run(
            demo=demo,
            events=events,
            concurrency=concurrency,
            pool=pool,
            as_json=out.as_json,
            nodes=nodes,
        )
    )


# -- wm recover ----------------------------------------------------------------------------------


@click.command(cls=Command)
@pass_output
def recover(out: Output) -> int:
    """Run recovery now: routes, queues, workers' code, the outbox.

    What a starting node does, under the same lease (refused while a recovery runs
    elsewhere): repair the routing table, declare every subscription's queue, check each
    running worker's code and engine, publish lifecycle events left in the outbox. Prints
    what it did and each worker it could not bring back; exits 1 if there is any.
    """
    from wm.cli.output import labelled

    report = out.manager.recover()
    if out.as_json:
        out.json(report.to_json())
        return 1 if report.failures else 0
    out.fields(
        [
            ("routes repaired", report.routes_repaired),
            ("queues declared", report.queues_declared),
            ("workers checked", report.workers_checked),
            ("events published", report.events_published),
            ("failures", len(report.failures)),
            ("took", f"{report.seconds:.1f} s"),
        ]
    )
    rows = [(labelled(f.worker_id, f.name), f.queue, f.reason) for f in report.failures]
    if rows:
        out.table(["WORKER", "QUEUE", "REASON"], rows, empty="", wrap=("REASON",))
    return 1 if report.failures else 0


# -- wm health -----------------------------------------------------------------------------------


@click.command(cls=Command)
@click.option(
    "--node",
    metavar="URL",
    help="The node's health endpoint, or HOST:PORT. [default: http://127.0.0.1:$WM_HEALTH_PORT/health]",
)
@pass_output
def health(out: Output, node: str | None) -> int:
    """A node's health: exit 0 healthy, 1 degraded, 2 unhealthy, 3 unknown (no answer)."""
    try:
        url = _node_url(node) if node else _local_health_url(out)
        _, found = component("wm.ops.health").fetch(url)
    except WorkManagerError as exc:  # not asked: neither healthy nor not (a monitor's UNKNOWN)
        exc.exit_code = UNKNOWN_EXIT  # type: ignore[attr-defined]
        raise
    status = str(found.get("status", "unhealthy"))
    if out.as_json:
        out.json(found)
    else:
        out.fields(_health_fields(found, status))
        for reason in found.get("reasons", []):
            out.line(f"- {reason}")
    return HEALTH_EXIT.get(status, UNHEALTHY_EXIT)


def _node_url(node: str) -> str:
    """``--node`` as a URL: ``HOST:PORT`` and a URL without a path ask ``/health``."""
    url = node if "://" in node else f"http://{node}"
    scheme, rest = url.split("://", 1)
    return url if "/" in rest else f"{scheme}://{rest}/health"


def _local_health_url(out: Output) -> str:
    if not out.settings.health_port:
        raise InvalidArgument(
            "no node to ask: pass --node URL, or set WM_HEALTH_PORT to a local node's port"
        )
    return f"http://127.0.0.1:{out.settings.health_port}/health"


def _health_fields(found: dict[str, Any], status: str) -> list[tuple[str, Any]]:
    checks = found.get("checks", {})
    return [
        ("node", found.get("node")),
        ("status", status),
        *[
            (name, "ok" if check["ok"] else f"FAILED: {check.get('error')}")
            for name, check in checks.items()
        ],
        ("recovery", found.get("recovery", {}).get("state")),
        ("consuming", "yes" if found.get("consuming") else "no"),
        *[(mime_type, _facts(facts)) for mime_type, facts in found.get("engines", {}).items()],
    ]


def _facts(facts: dict[str, Any]) -> str:
    """``sandbox layers: user namespace, …; sandbox missing: none`` for one engine."""
    shown = (
        f"{key.replace('_', ' ')}: {', '.join(map(str, value)) or 'none'}"
        if isinstance(value, list)
        else f"{key.replace('_', ' ')}: {value}"
        for key, value in facts.items()
    )
    return "; ".join(shown)


# -- wm bench ------------------------------------------------------------------------------------


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("bench_args", nargs=-1, type=click.UNPROCESSED)
def bench(bench_args: tuple[str, ...]) -> int:
    """Run the benchmarks (wm bench --help shows their options).

    Every argument, -h and --json included, is the benchmark's own.
    """
    args = list(bench_args)
    root = click.get_current_context().find_root().obj
    if getattr(root, "as_json", False) and "--json" not in args:
        args.append("--json")  # ``wm --json bench …`` means the benchmark's JSON
    try:
        return int(component("wm.bench.command").main(args))
    except SystemExit as exc:  # its parser's --help (0) and usage errors (2): an exit code
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        raise


# -- wm completion -------------------------------------------------------------------------------


@click.command(cls=Command)
@click.argument("shell", type=click.Choice(SHELLS), required=False)
@pass_output
def completion(out: Output, shell: str | None) -> int:
    """Print the shell completion script (SHELL: default the one $SHELL names, else bash).

    \b
    bash: eval "$(wm completion bash)"   in ~/.bashrc
    zsh:  eval "$(wm completion zsh)"    in ~/.zshrc
    fish: wm completion fish > ~/.config/fish/completions/wm.fish
    """
    from click.shell_completion import get_completion_class

    shell = shell or _login_shell()
    complete = get_completion_class(shell)
    assert complete is not None, shell  # click ships a class for every name in SHELLS
    root = click.get_current_context().find_root().command
    script = complete(root, {}, PROG_NAME, COMPLETE_VAR).source()
    if out.as_json:
        out.json({"shell": shell, "script": script})
    else:
        out.line(script.rstrip("\n"))
    return 0


def _login_shell() -> str:
    name = os.path.basename(os.environ.get("SHELL", ""))
    return name if name in SHELLS else SHELLS[0]


def component(name: str, *, extra: str | None = None) -> Any:
    """Imported only when its command runs: it needs what no other command loads (and, with
    ``extra``, what only that extra of the package installs)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            raise MissingDependency(f"{name} is missing from this installation") from exc
        if extra is None:
            raise
        raise MissingDependency(
            f"{name} needs the [{extra}] extra (module {exc.name!r} is missing): "
            f"{install_hint(extra)}"
        ) from exc
