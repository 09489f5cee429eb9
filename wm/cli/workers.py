"""``wm worker …``: deploy code as workers and operate them."""

from __future__ import annotations

import argparse
import base64
from typing import TYPE_CHECKING

from wm.cli.arguments import (
    add_command,
    add_group,
    key_value,
    number_or_text,
    positive_int,
    read_bytes,
)
from wm.cli.output import Context
from wm.codesource import decode_base64
from wm.lifecycle import Status
from wm.views import WorkerInfo

if TYPE_CHECKING:
    from wm.cli.arguments import Commands

_WORKER_HELP = "worker id, or the name of a live worker"


def register(commands: Commands, common: argparse.ArgumentParser) -> None:
    workers = add_group(commands, "worker", common, "create and operate workers")
    _create_parser(workers, common)
    listing = add_command(workers, "list", list_workers, common, "list workers (not deleted)")
    listing.add_argument("--topic")
    listing.add_argument("--group")
    listing.add_argument("--status", choices=[str(s) for s in Status])
    for name, handler, help in (
        ("show", show, "show one worker"),
        (
            "suspend",
            suspend,
            "pause consuming on every node; queue and loaded engines stay (idempotent)",
        ),
        ("resume", resume, "consume again what accumulated while suspended"),
        ("delete", delete, "delete the worker and its queue; versions and history stay"),
        ("history", history, "list the worker's code versions"),
        ("transitions", transitions, "list the worker's state changes"),
    ):
        add_command(workers, name, handler, common, help).add_argument("worker", help=_WORKER_HELP)
    starting = add_command(
        workers, "start", start, common, "start consuming the worker's topic (idempotent)"
    )
    starting.add_argument("worker", help=_WORKER_HELP)
    starting.add_argument(
        "--delay",
        type=float,
        metavar="SECONDS",
        help="start this much later: the worker is pending until then",
    )
    stopping = add_command(
        workers,
        "stop",
        stop,
        common,
        "stop consuming, wait for deliveries in flight, unload the engine; the queue keeps "
        "what arrives (idempotent)",
    )
    stopping.add_argument("worker", help=_WORKER_HELP)
    stopping.add_argument(
        "--grace",
        type=float,
        metavar="SECONDS",
        help="wait this long for deliveries in flight, then kill the engine (status killed; "
        "they run again on start); default: the worker's stop_grace_s, else 30",
    )
    update = add_command(
        workers,
        "update-code",
        update_code,
        common,
        "add a code version and make it current (hot reload)",
    )
    update.add_argument("worker", help=_WORKER_HELP)
    _code_source(update)
    update.add_argument("--note", help="why this version exists")
    rollback = add_command(
        workers, "rollback", rollback_worker, common, "make an earlier code version current again"
    )
    rollback.add_argument("worker", help=_WORKER_HELP)
    rollback.add_argument("version", type=positive_int)
    code = add_command(workers, "code", show_code, common, "write a version's code to stdout")
    code.add_argument("worker", help=_WORKER_HELP)
    code.add_argument("--version", type=positive_int, help="default: the current version")


def _create_parser(workers: Commands, common: argparse.ArgumentParser) -> None:
    create = add_command(workers, "create", create_worker, common, "deploy code as a new worker")
    create.add_argument("--topic", required=True, help="topic whose events the worker handles")
    create.add_argument("--mime-type", required=True, help="selects the engine")
    _code_source(create)
    create.add_argument("--group", help="members of a group never run at the same time")
    create.add_argument("--name", help="unique among live workers; usable instead of the id")
    create.add_argument("--no-start", action="store_true", help="leave it in status created")
    create.add_argument(
        "--setting",
        action="append",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="per-worker setting, e.g. timeout_s=5",
    )


def _code_source(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", metavar="PATH", help="code file; - reads standard input")
    source.add_argument("--base64", metavar="TEXT", help="code as standard base64")
    source.add_argument("--url", help="fetch the code (https, SSRF-guarded)")
    parser.add_argument("--sha256", metavar="HEX", help="refuse code with another SHA-256")


def _code(args: argparse.Namespace) -> bytes | None:
    """Inline code from ``--file`` or ``--base64``; None when the code comes from ``--url``."""
    if args.file is not None:
        return read_bytes(args.file)
    if args.base64 is not None:
        return decode_base64(args.base64)
    return None


def create_worker(ctx: Context, args: argparse.Namespace) -> int:
    info = ctx.manager.create_worker(
        code=_code(args),
        url=args.url,
        mime_type=args.mime_type,
        topic=args.topic,
        group=args.group,
        name=args.name,
        start=not args.no_start,
        sha256=args.sha256,
        settings={key: number_or_text(value) for key, value in args.setting},
    )
    _print_worker(ctx, info)
    return 0


def update_code(ctx: Context, args: argparse.Namespace) -> int:
    code = _code(args)
    if code is None:
        info = ctx.manager.load_code_from_url(
            args.worker, args.url, sha256=args.sha256, note=args.note
        )
    else:
        info = ctx.manager.load_code_from_content(
            args.worker, code, sha256=args.sha256, note=args.note
        )
    _print_summary(ctx, info)
    return 0


def list_workers(ctx: Context, args: argparse.Namespace) -> int:
    found = ctx.manager.list_workers(topic=args.topic, group=args.group, status=args.status)
    if ctx.as_json:
        ctx.json([info.to_json() for info in found])
        return 0
    ctx.table(
        ["ID", "NAME", "TOPIC", "GROUP", "STATUS", "HEALTH", "VERSION", "MIME TYPE"],
        (
            [i.id, i.name, i.topic, i.group, i.status, i.health, i.current_version, i.mime_type]
            for i in found
        ),
        empty="no workers",
    )
    return 0


def show(ctx: Context, args: argparse.Namespace) -> int:
    _print_worker(ctx, ctx.manager.get_worker(args.worker))
    return 0


def start(ctx: Context, args: argparse.Namespace) -> int:
    _print_summary(ctx, ctx.manager.start_worker(args.worker, delay_s=args.delay))
    return 0


def stop(ctx: Context, args: argparse.Namespace) -> int:
    _print_summary(ctx, ctx.manager.stop_worker(args.worker, grace_s=args.grace))
    return 0


def suspend(ctx: Context, args: argparse.Namespace) -> int:
    _print_summary(ctx, ctx.manager.suspend_worker(args.worker))
    return 0


def resume(ctx: Context, args: argparse.Namespace) -> int:
    _print_summary(ctx, ctx.manager.resume_worker(args.worker))
    return 0


def delete(ctx: Context, args: argparse.Namespace) -> int:
    _print_summary(ctx, ctx.manager.delete_worker(args.worker))
    return 0


def rollback_worker(ctx: Context, args: argparse.Namespace) -> int:
    info = ctx.manager.rollback_worker(args.worker, args.version)
    _print_summary(ctx, info)
    return 0


def history(ctx: Context, args: argparse.Namespace) -> int:
    info = ctx.manager.get_worker(args.worker)
    versions = ctx.manager.get_worker_history(info.id)
    if ctx.as_json:
        ctx.json([v.to_json() for v in versions])
        return 0
    ctx.table(
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
    )
    return 0


def transitions(ctx: Context, args: argparse.Namespace) -> int:
    found = ctx.manager.get_worker_transitions(args.worker)
    if ctx.as_json:
        ctx.json([t.to_json() for t in found])
        return 0
    ctx.table(
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
    """How long the worker was in the state it left: ``850 ms``, ``12.3 s``, ``4 min``."""
    if ms is None:
        return None
    if ms < 1000:
        return f"{ms} ms"
    return f"{ms / 1000:.1f} s" if ms < 120_000 else f"{ms // 60_000} min"


def show_code(ctx: Context, args: argparse.Namespace) -> int:
    info = ctx.manager.get_worker(args.worker)
    version = args.version or info.current_version
    code = ctx.manager.get_code(info.id, version)
    if ctx.as_json:
        ctx.json(
            {
                "worker_id": str(info.id),
                "version": version,
                "code_base64": base64.b64encode(code).decode("ascii"),
            }
        )
    else:
        ctx.raw(code)
    return 0


def _print_worker(ctx: Context, info: WorkerInfo) -> None:
    if ctx.as_json:
        ctx.json(info.to_json())
        return
    ctx.fields(
        [
            ("id", info.id),
            ("name", info.name),
            ("topic", info.topic),
            ("group", info.group),
            ("mime type", info.mime_type),
            ("status", info.status),
            ("since", info.status_since),
            ("health", info.health),
            ("version", info.current_version),
            ("sha256", info.sha256),
            ("size", info.size),
            ("settings", dict(info.settings)),
            ("created", info.created_at),
            ("started", info.started_at),
            ("updated", info.updated_at),
        ]
    )


def _print_summary(ctx: Context, info: WorkerInfo) -> None:
    if ctx.as_json:
        ctx.json(info.to_json())
        return
    who = f"{info.id} ({info.name})" if info.name else str(info.id)
    ctx.line(f"worker {who}: {info.status}, version {info.current_version}")
