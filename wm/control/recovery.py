"""Recovery on request (``wm recover``, ``POST /v1/recover``): the recovery a starting node
runs (``wm.dataplane.recovery``), under the same lease, from wherever the caller is. For an
operator who repaired what a recovery reported, or who runs nodes with
WORKER_RECOVERY_ON_START=false."""

from __future__ import annotations

import socket

from wm.control.context import Context
from wm.views import RecoveryReport


def recover(context: Context, *, own_tenant: bool = False) -> RecoveryReport:
    """Run recovery now (the report of the context's tenant alone with ``own_tenant``);
    raises :class:`wm.errors.RecoveryRunning` while another holds the lease."""
    from wm.dataplane import recovery

    holder = f"{context.actor}@{socket.gethostname()}"
    tenant = context.tenant if own_tenant else None
    return recovery.recover(context.settings, context.bus.app, holder, tenant)
