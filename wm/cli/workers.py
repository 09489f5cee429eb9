"""``wm worker …``: deploy code as workers and operate them."""

from __future__ import annotations

import base64
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import click

from wm.cli.arguments import (
    KEY_VALUE,
    NON_NEGATIVE_FLOAT,
    POSITIVE_INT,
    Group,
    number_or_text,
    pass_output,
    read_bytes,
)
from wm.cli.output import Output, cell, duration, unavailable, unavailable_reasons
from wm.lifecycle import Status
from wm.names import DEFAULT_TENANT

if TYPE_CHECKING:
    from wm.views import DeliveryCounts, LastError, WorkerDetails, WorkerInfo


@click.group(cls=Group)
def worker() -> None:
    """Create and operate workers.

    WORKER: a worker's id, a unique prefix of it (6+ characters), or a live worker's name.
    """


def _code_options(function: Any) -> Any:
    for option in reversed(
        (
            click.option("--file", metavar="PATH", help="Code file; - reads standard input."),
            click.option("--base64", "base64_text", metavar="TEXT", help="Code as base64."),
            click.option("--url", help="Fetch the code (https, SSRF-guarded)."),
            click.option("--sha256", metavar="HEX", help="Refuse code with another SHA-256."),
        )
    ):
        function = option(function)
    return function


def _code(file: str | None, base64_text: str | None, url: str | None) -> bytes | None:
    """Inline code from ``--file`` or ``--base64``; None when the code comes from ``--url``."""
    given = [
        flag
        for flag, value in (("--file", file), ("--base64", base64_text), ("--url", url))
        if value is not None
    ]
    if len(given) != 1:
        raise click.UsageError(
            "give the code with exactly one of --file, --base64, --url"
            + (f" (got {', '.join(given)})" if given else "")
        )
    if file is not None:
        return read_bytes(file)
    if base64_text is not None:
        from wm.codesource import decode_base64

        return decode_base64(base64_text)
    return None


@worker.command("create")
@click.option("--topic", required=True, help="Topic whose events the worker handles.")
@click.option(
    "--mime-type",
    help="Selects the engine, e.g. text/x-python. [default: from the --file or --url name: "
    ".py, .cs, .nupkg or .dll, .zip]",
)
@_code_options
@click.option("--group", help="Its group: members take turns on every event, or share the events.")
@click.option(
    "--group-mode",
    type=click.Choice(["exclusive", "shared"]),
    metavar="MODE",
    help="exclusive (default): members run every event, one at a time; shared: each event "
    "runs on one member.",
)
@click.option("--name", help="Unique among the tenant's live workers; usable instead of the id.")
@click.option("--no-start", is_flag=True, help="Leave it in status created.")
@click.option(
    "--setting",
    "settings",
    multiple=True,
    type=KEY_VALUE,
    help="Per-worker setting, e.g. timeout_s=5 (repeatable).",
)
@pass_output
def create_worker(
    out: Output,
    topic: str,
    mime_type: str | None,
    file: str | None,
    base64_text: str | None,
    url: str | None,
    sha256: str | None,
    group: str | None,
    group_mode: str | None,
    name: str | None,
    no_start: bool,
    settings: tuple[tuple[str, str], ...],
) -> int:
    """Deploy code as a new worker."""
    info = out.manager.create_worker(
        code=_code(file, base64_text, url),
        url=url,
        mime_type=mime_type or _mime_type_of(file or url),
        topic=topic,
        group=group,
        name=name,
        start=not no_start,
        sha256=sha256,
        settings={key: number_or_text(value) for key, value in settings},
        group_mode=group_mode,
    )
    _print_worker(out, info)
    return 0


#: The engine a code file's name tells, when ``--mime-type`` is not given.
MIME_TYPES_BY_SUFFIX = {
    ".py": "text/x-python",
    ".cs": "text/x-csharp",
    ".nupkg": "application/x-dotnet-dll",
    ".dll": "application/x-dotnet-dll",
    ".zip": "application/x-native-dll",
}


def _mime_type_of(name: str | None) -> str:
    """The MIME type :data:`MIME_TYPES_BY_SUFFIX` gives ``name`` (a path or URL)."""
    path = urlsplit(name).path if name and "://" in name else (name or "")
    suffix = PurePosixPath(path).suffix.lower()
    found = MIME_TYPES_BY_SUFFIX.get(suffix)
    if found is None:
        known = ", ".join(f"{s} ({t})" for s, t in MIME_TYPES_BY_SUFFIX.items())
        what = f"the name {name!r}" if name and name != "-" else "code without a file name"
        raise click.UsageError(
            f"--mime-type is needed: the engine cannot be told from {what}; the names that "
            f"tell it end in {known}"
        )
    return found


@worker.command("update-code")
@click.argument("worker_ref", metavar="WORKER")
@_code_options
@click.option("--note", help="Why this version exists.")
@pass_output
def update_code(
    out: Output,
    worker_ref: str,
    file: str | None,
    base64_text: str | None,
    url: str | None,
    sha256: str | None,
    note: str | None,
) -> int:
    """Add a code version and make it current (hot reload)."""
    code = _code(file, base64_text, url)
    if code is None:
        assert url is not None
        info = out.manager.load_code_from_url(worker_ref, url, sha256=sha256, note=note)
    else:
        info = out.manager.load_code_from_content(worker_ref, code, sha256=sha256, note=note)
    _print_summary(out, info)
    return 0


def _health(info: WorkerInfo) -> str:
    """The health column: ``unhealthy (paused)`` while health pauses the worker."""
    return f"{info.health} (paused)" if info.paused else info.health


@worker.command("list")
@click.option("--topic", help="Only workers of this topic.")
@click.option("--group", help="Only workers of this group.")
@click.option(
    "--status",
    type=click.Choice([str(s) for s in Status]),
    help="Only workers in this status (deleted ones only so).",
)
@pass_output
def list_workers(out: Output, topic: str | None, group: str | None, status: str | None) -> int:
    """List workers (not deleted), oldest first."""
    found = out.reader.list_workers(topic=topic, group=group, status=status)
    if out.as_json:
        out.json([info.to_json() for info in found])
        return 0
    headers = ["ID", "NAME", "TOPIC", "GROUP", "STATUS", "HEALTH", "VERSION", "MIME TYPE"]
    rows = [
        [i.id, i.name, i.topic, i.group, i.status, _health(i), i.current_version, i.mime_type]
        for i in found
    ]
    if out.reader.tenant != DEFAULT_TENANT:  # the default tenant's listing is as before
        headers.insert(0, "TENANT")
        rows = [[i.tenant, *row] for i, row in zip(found, rows, strict=True)]
    out.table(headers, rows, empty="no workers")
    return 0


@worker.command("show")
@click.argument("worker_ref", metavar="WORKER")
@pass_output
def show(out: Output, worker_ref: str) -> int:
    """Show one worker, its queue depth, dead letters, last error and recent deliveries."""
    details = out.reader.worker_details(worker_ref)
    _print_worker(out, details.worker, details)
    return 0


@worker.command("start")
@click.argument("worker_ref", metavar="WORKER")
@click.option(
    "--delay",
    type=NON_NEGATIVE_FLOAT,
    metavar="SECONDS",
    help="Start this much later: the worker is pending until then.",
)
@pass_output
def start(out: Output, worker_ref: str, delay: float | None) -> int:
    """Start consuming the worker's topic (idempotent)."""
    _print_summary(out, out.manager.start_worker(worker_ref, delay_s=delay))
    return 0


@worker.command("stop")
@click.argument("worker_ref", metavar="WORKER")
@click.option(
    "--grace",
    type=NON_NEGATIVE_FLOAT,
    metavar="SECONDS",
    help="Wait this long for deliveries in flight, then kill the engine (status killed; they "
    "run again on start). Default: the worker's stop_grace_s, else 30.",
)
@pass_output
def stop(out: Output, worker_ref: str, grace: float | None) -> int:
    """Stop consuming, wait for deliveries in flight, unload the engine.

    The queue keeps what arrives meanwhile (idempotent).
    """
    _print_summary(out, out.manager.stop_worker(worker_ref, grace_s=grace))
    return 0


@worker.command("suspend")
@click.argument("worker_ref", metavar="WORKER")
@pass_output
def suspend(out: Output, worker_ref: str) -> int:
    """Pause consuming on every node; queue and loaded engines stay (idempotent)."""
    _print_summary(out, out.manager.suspend_worker(worker_ref))
    return 0


@worker.command("resume")
@click.argument("worker_ref", metavar="WORKER")
@pass_output
def resume(out: Output, worker_ref: str) -> int:
    """Consume again what accumulated while suspended."""
    _print_summary(out, out.manager.resume_worker(worker_ref))
    return 0


@worker.command("delete")
@click.argument("worker_ref", metavar="WORKER")
@pass_output
def delete(out: Output, worker_ref: str) -> int:
    """Delete the worker and its queue; versions and history stay."""
    _print_summary(out, out.manager.delete_worker(worker_ref))
    return 0


@worker.command("rollback")
@click.argument("worker_ref", metavar="WORKER")
@click.argument("version", type=POSITIVE_INT)
@pass_output
def rollback_worker(out: Output, worker_ref: str, version: int) -> int:
    """Make an earlier code version current again."""
    _print_summary(out, out.manager.rollback_worker(worker_ref, version))
    return 0


@worker.command("history")
@click.argument("worker_ref", metavar="WORKER")
@pass_output
def history(out: Output, worker_ref: str) -> int:
    """List the worker's code versions (a deleted worker's too)."""
    versions = out.reader.get_worker_history(worker_ref)
    if out.as_json:
        out.json([v.to_json() for v in versions])
        return 0
    # by id: found when deleted too; its current version only, so no health from Redis
    info = out.reader.get_worker(versions[0].worker_id, health=False)
    out.table(
        ["VERSION", "CURRENT", "SOURCE", "SIZE", "SHA256", "CREATED", "NOTE"],
        (
            [
                v.version,
                "*" if v.version == info.current_version else "",
                v.url or v.source_kind,
                v.size,
                v.sha256,
                v.created_at,
                v.note,
            ]
            for v in versions
        ),
        empty="no versions",
        wrap=("SOURCE",),
    )
    return 0


@worker.command("transitions")
@click.argument("worker_ref", metavar="WORKER")
@pass_output
def transitions(out: Output, worker_ref: str) -> int:
    """List the worker's state changes, oldest first (a deleted worker's too)."""
    found = out.reader.get_worker_transitions(worker_ref)
    if out.as_json:
        out.json([t.to_json() for t in found])
        return 0
    out.table(
        ["AT", "FROM", "TO", "BY", "AFTER", "VERSION", "REASON"],
        (
            [
                t.at,
                t.from_status,
                t.to_status,
                t.actor,
                _duration(t.duration_ms),
                t.version,
                t.reason,
            ]
            for t in found
        ),
        empty="no transitions",
    )
    return 0


def _duration(ms: int | None) -> str | None:
    """How long the worker was in the state it left."""
    return None if ms is None else duration(ms / 1000)


@worker.command("code")
@click.argument("worker_ref", metavar="WORKER")
@click.option("--version", type=POSITIVE_INT, help="Default: the current version.")
@pass_output
def show_code(out: Output, worker_ref: str, version: int | None) -> int:
    """Write a version's code to standard output."""
    info = out.reader.get_worker(worker_ref, health=False)  # its id and version: no Redis
    version = version or info.current_version
    code = out.reader.get_code(info.id, version)
    if out.as_json:
        out.json(
            {
                "worker_id": str(info.id),
                "version": version,
                "code_base64": base64.b64encode(code).decode("ascii"),
            }
        )
    else:
        out.raw(code)
    return 0


def _print_worker(out: Output, info: WorkerInfo, details: WorkerDetails | None = None) -> None:
    """The worker's record; with ``details`` (``worker show``) what an operator looks at next."""
    if out.as_json:
        out.json(info.to_json() if details is None else details.to_json())
        return
    out.fields(
        [
            ("id", info.id),
            *([] if info.tenant == DEFAULT_TENANT else [("tenant", info.tenant)]),
            ("name", info.name),
            ("topic", info.topic),
            ("group", info.group),
            ("mime type", info.mime_type),
            ("status", info.status),
            ("since", info.status_since),
            ("health", info.health),
            ("paused", info.paused and f"{info.paused}: its queue is kept, not consumed"),
            ("version", info.current_version),
            ("sha256", info.sha256),
            ("size", info.size),
            ("settings", dict(info.settings)),
            ("created", info.created_at),
            ("started", info.started_at),
            ("updated", info.updated_at),
            *([] if details is None else _details(details)),
        ]
    )


def _details(details: WorkerDetails) -> list[tuple[str, Any]]:
    missing = details.unavailable
    broker, redis = unavailable("broker", missing), unavailable("redis", missing)
    error = details.last_error
    return [
        ("queue", details.queue),
        ("queued", broker or details.queue_depth),
        ("dead letters", f"{details.dead_letters} not replayed"),
        ("last error", error and f"{cell(error.at)} ({error.source}): {_error_text(error)}"),
        ("last minute", redis or _deliveries(details.deliveries_last_minute)),
        ("health window", redis or _deliveries(details.deliveries_window)),
        ("breaker", redis or _breaker(details)),
        *unavailable_reasons(missing),
    ]


def _error_text(error: LastError) -> str:
    return f"{error.error_type}: {error.message}" if error.error_type else error.message


def _deliveries(counts: DeliveryCounts | None) -> str | None:
    if counts is None:
        return None
    return f"{counts.ok} ok, {counts.failed} failed since {cell(counts.since)}"


def _breaker(details: WorkerDetails) -> str | None:
    found = details.breaker
    if found is None:
        return None
    text = (
        f"{found.state}: {found.consecutive_failures} failed in a row "
        f"(threshold {found.threshold or 'off'}), strategy {found.strategy}"
    )
    return text + (f", retry at {cell(found.retry_at)}" if found.retry_at else "")


def _print_summary(out: Output, info: WorkerInfo) -> None:
    if out.as_json:
        out.json(info.to_json())
        return
    who = f"{info.id} ({info.name})" if info.name else str(info.id)
    out.line(f"worker {who}: {info.status}, version {info.current_version}")
