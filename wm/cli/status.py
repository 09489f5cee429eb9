"""``wm status``: the one screen an operator opens first.

A summary block (nodes, workers, health, queued messages, dead letters, breakers, recovery),
then a table for each part that has rows. A service that does not answer leaves its parts
marked unavailable with the reason; the rest is still shown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click

from wm.cli.arguments import POSITIVE_FLOAT, Command, pass_output
from wm.cli.output import Output, duration, labelled, unavailable, unavailable_reasons

if TYPE_CHECKING:
    from wm.views import BreakerInfo, Overview

#: Seconds the nodes have to answer the ping: the API's default
#: (``wm.control.overview.PING_TIMEOUT_S``), not imported so that help starts fast.
PING_TIMEOUT_S = 1.0


@click.command(cls=Command)
@click.option(
    "--ping-timeout",
    type=POSITIVE_FLOAT,
    default=PING_TIMEOUT_S,
    metavar="SECONDS",
    help="How long the nodes have to answer the ping.",
)
@pass_output
def status(out: Output, ping_timeout: float) -> int:
    """One screen: nodes, workers by state, queues, dead letters, breakers.

    Parts whose service (broker, Redis) does not answer are marked unavailable; an
    unreachable database is an error.
    """
    found = out.reader.status(ping_timeout_s=ping_timeout)
    if out.as_json:
        out.json(found.to_json())
        return 0
    out.fields(_summary(found, ping_timeout))
    _queues(out, found)
    _dead_letters(out, found)
    _breakers(out, found)
    _tenants(out, found)
    return 0


def _summary(found: Overview, ping_timeout: float) -> list[tuple[str, Any]]:
    missing = found.unavailable
    return [
        ("nodes", _nodes(found.nodes, ping_timeout, missing)),
        ("workers", f"{found.workers}" + _counts(found.by_status, ": ")),
        ("health", unavailable("redis", missing) or _counts(found.by_health or {}) or "-"),
        ("queued", _queued(found, missing)),
        ("dead letters", _letters(found.dead_letters)),
        ("breakers", unavailable("redis", missing) or _breaker_counts(found)),
        ("recovery", unavailable("redis", missing) or _recovery(found)),
        *unavailable_reasons(missing),
    ]


def _counts(counts: Mapping[str, int], lead: str = "") -> str:
    """``running 2, stopped 1``."""
    return lead + ", ".join(f"{key} {n}" for key, n in counts.items()) if counts else ""


def _nodes(nodes: Sequence[str] | None, ping_timeout: float, missing: Mapping[str, str]) -> str:
    if nodes is None:
        return unavailable("broker", missing) or "unavailable"
    if not nodes:
        return f"none answered the ping within {ping_timeout:g} s"
    return f"{len(nodes)} alive: {', '.join(nodes)}"


def _queued(found: Overview, missing: Mapping[str, str]) -> str:
    if found.queued is None:
        return unavailable("broker", missing) or "unavailable"
    return f"{found.queued} messages waiting in worker queues" if found.queued else "none"


def _letters(letters: Mapping[str, int]) -> str:
    total = sum(letters.values())
    topics = "topic" if len(letters) == 1 else "topics"
    return f"{total} not replayed, in {len(letters)} {topics}" if total else "none"


def _breaker_counts(found: Overview) -> str:
    breakers = found.recovery.breakers if found.recovery else []
    states: dict[str, int] = {}
    for breaker in breakers:
        states[breaker.state] = states.get(breaker.state, 0) + 1
    return _counts(states) or "all closed"


def _recovery(found: Overview) -> str:
    recovery = found.recovery
    if recovery is None:
        return "-"
    lease = recovery.leader_lease_s
    leading = "no node recovering" if lease is None else f"a node recovers (lease {lease:.0f} s)"
    return f"{leading}; maintaining node {recovery.maintaining_node or 'unknown'}"


def _heading(out: Output, title: str) -> None:
    from rich.text import Text

    out.line()
    out.console.print(Text(title, style="bold"))


def _queues(out: Output, found: Overview) -> None:
    if not found.deepest_queues:
        return
    _heading(out, "Deepest queues")
    out.table(
        ["DEPTH", "TOPIC", "WORKER"],
        ([q.depth, q.topic, labelled(q.worker_id, q.name)] for q in found.deepest_queues),
        empty="no messages waiting",
    )


def _dead_letters(out: Output, found: Overview) -> None:
    if not found.dead_letters:
        return
    _heading(out, "Dead letters not replayed (wm dlq list)")
    out.table(
        ["COUNT", "TOPIC"],
        ([count, topic] for topic, count in found.dead_letters.items()),
        empty="none",
    )


def _breakers(out: Output, found: Overview) -> None:
    if found.recovery is None or not found.recovery.breakers:
        return
    _heading(out, "Circuit breakers")
    out.table(
        ["STATE", "FAILED", "TRIPS", "RETRY IN", "WORKER"],
        (_breaker_row(b, found.at) for b in found.recovery.breakers),
        empty="all closed",
    )


def _tenants(out: Output, found: Overview) -> None:
    """Shown once there is more than the default tenant, or a tenant has a limit."""
    limited = any(any(v is not None for v in t.limits.to_json().values()) for t in found.tenants)
    if len(found.tenants) < 2 and not limited:
        return
    _heading(out, "Tenants (limits '-': unlimited; use counted where a delivery limit is set)")
    out.table(
        ["TENANT", "WORKERS", "IN FLIGHT", "RATE /S", "MAX_WORKERS"],
        (
            [
                t.name,
                t.workers,
                _use(t.in_flight, t.limits.shown("max_concurrency")),
                _use(t.rate, t.limits.shown("rate_limit")),
                t.limits.shown("max_workers"),
            ]
            for t in found.tenants
        ),
        empty="no tenants",
    )


def _use(used: int | None, limit: str) -> str:
    """``3/10``: in use of the limit."""
    return f"{'-' if used is None else used}/{limit}"


def _breaker_row(breaker: BreakerInfo, now: datetime) -> list[Any]:
    """Narrow enough that a worker's ``name (id)`` keeps its id on one line at 80 columns."""
    state = f"{breaker.state} ({breaker.strategy})" if breaker.state == "tripped" else breaker.state
    return [
        state,
        f"{breaker.consecutive_failures}/{breaker.threshold or '-'}",
        breaker.trips,
        None if breaker.retry_at is None else _until(breaker.retry_at, now),
        labelled(breaker.worker_id, breaker.name),
    ]


def _until(at: datetime, now: datetime) -> str:
    """``95 s``, ``12 min``, or ``due`` once the time has come."""
    seconds = (at - now).total_seconds()
    if seconds <= 0:
        return "due"
    return duration(seconds)
