"""``wm session …``: where a session of a worker with ``session_key`` is bound, and ending a
binding (see docs/guides/session-affinity.md)."""

from __future__ import annotations

import click

from wm.cli.arguments import Group, pass_output
from wm.cli.output import Output


@click.group(cls=Group)
def session() -> None:
    """Show or end a session's binding to an engine instance."""


@session.command("show")
@click.argument("worker_ref", metavar="WORKER")
@click.argument("session_id", metavar="SESSION")
@pass_output
def show_session(out: Output, worker_ref: str, session_id: str) -> int:
    """The instance (host:pid) SESSION of WORKER is bound to, and for how long."""
    info = out.reader.session(worker_ref, session_id)
    if out.as_json:
        out.json(info.to_json())
    elif info.instance is None:
        out.line(f"session {session_id} of worker {info.worker_id} is not bound")
    else:
        out.line(
            f"session {session_id} of worker {info.worker_id} is bound to {info.instance} "
            f"for {info.expires_in_s:.0f} s more"
        )
    return 0


@session.command("unbind")
@click.argument("worker_ref", metavar="WORKER")
@click.argument("session_id", metavar="SESSION")
@pass_output
def unbind_session(out: Output, worker_ref: str, session_id: str) -> int:
    """End SESSION's binding: its next event binds to whichever instance takes it."""
    ended = out.manager.unbind_session(worker_ref, session_id)
    if out.as_json:
        out.json({"session": session_id, "unbound": ended})
    else:
        out.line(f"session {session_id} {'unbound' if ended else 'was not bound'}")
    return 0
