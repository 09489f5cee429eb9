"""A shared group on the data plane (DESIGN.md §6, ``wm.store.shares``): which member runs a
delivery, and when the share's one queue stops being consumed.

Every node consumes the share's queue while at least one member runs. Each delivery picks
one of the members that runs now, at random, so the members share the events about evenly;
a member that stops, is suspended, paused or deleted is picked no more at once, and what
waits in the queue goes to the others. A delivery picked for a member that stops while it
runs goes back to the queue (the interruption feature), and its next pick is another's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.orm import Session

from wm.dataplane.routes import route_of
from wm.lifecycle import Status
from wm.state.directory import Directory, WorkerMeta
from wm.store import shares
from wm.store.models import Worker
from wm.store.shares import Share


def pick(
    directory: Directory, share: Share, fact_keys: Callable[[str], Sequence[str]]
) -> tuple[WorkerMeta, dict[str, Any]] | None:
    """A running member of ``share`` and its features' facts (``fact_keys``' values, read
    with its entry); None when no member runs. Members are tried in a random order, each
    one round trip."""
    for member in random.sample(share.members, len(share.members)):
        keys = list(fact_keys(member))
        meta, values = directory.get_with(member, *keys)
        if meta is not None and meta.status == Status.RUNNING:
            return meta, dict(zip(keys, values, strict=True))
    return None


def leaving_queue(session: Session, worker: Worker) -> str | None:
    """The queue nodes stop consuming as ``worker`` stops running: its own, or its share's
    once no other member runs; None while another member still serves the share. Read in
    the transaction of the change; two members stopping at once may each see the other run,
    and the nodes' reconcile cancels the share's queue then."""
    if shares.others(session, worker, running=True):
        return None
    return route_of(worker).queue
