"""The worker state machine: one table of legal transitions (DESIGN.md §4, seeds 003/004).

``created → starting → running ⇄ (stopping →) stopped``, ``starting|running → failed``,
``failed → starting``, any → ``deleted`` (terminal; versions and transitions are kept).
``running ⇄ suspended`` (an operator pauses consuming; queue and engine stay), and
``running → pending → starting → running`` (the circuit breaker: consecutive failed
deliveries pause the worker for a back-off, then it tries again), ``running → finished``
(it processed its ``max_events``, its schedules ended or its code said so; ``start`` runs
it again), ``→ pending → starting → running`` for a start that must wait (``start`` with a
delay) from ``created``, ``stopped``, ``failed``, ``killed`` or ``finished``, and
``stopping → killed`` (its deliveries in flight outlived the stop's grace period: the node
killed the engine, and they are delivered again on the next start).
"""

from __future__ import annotations

from enum import StrEnum

from wm.errors import IllegalTransition, InvalidArgument


class Status(StrEnum):
    CREATED = "created"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    SUSPENDED = "suspended"
    PENDING = "pending"
    FINISHED = "finished"
    KILLED = "killed"
    DELETED = "deleted"


#: Legal transitions; anything else raises :class:`IllegalTransition`.
TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.CREATED: frozenset({Status.STARTING, Status.PENDING, Status.DELETED}),
    Status.STARTING: frozenset({Status.RUNNING, Status.FAILED, Status.DELETED}),
    Status.RUNNING: frozenset(
        {
            Status.STOPPING,
            Status.STOPPED,
            Status.FAILED,
            Status.SUSPENDED,
            Status.PENDING,
            Status.FINISHED,
            Status.DELETED,
        }
    ),
    Status.FINISHED: frozenset({Status.STARTING, Status.PENDING, Status.DELETED}),
    Status.SUSPENDED: frozenset({Status.RUNNING, Status.STOPPING, Status.DELETED}),
    Status.PENDING: frozenset({Status.STARTING, Status.SUSPENDED, Status.STOPPING, Status.DELETED}),
    Status.STOPPING: frozenset({Status.STOPPED, Status.KILLED, Status.FAILED, Status.DELETED}),
    Status.STOPPED: frozenset({Status.STARTING, Status.PENDING, Status.DELETED}),
    Status.KILLED: frozenset({Status.STARTING, Status.PENDING, Status.DELETED}),
    Status.FAILED: frozenset({Status.STARTING, Status.PENDING, Status.DELETED}),
    Status.DELETED: frozenset(),
}

#: States from which ``start`` has nothing to do (start is idempotent).
ALREADY_STARTED = frozenset({Status.STARTING, Status.RUNNING})
#: States in which a worker's queue is kept but not consumed until it runs again.
PAUSED = frozenset({Status.SUSPENDED, Status.PENDING})
#: States from which ``stop`` has nothing to do (stop is idempotent; never-started counts).
#: A worker left ``stopping`` (its stopper died while waiting) is stopped again.
ALREADY_STOPPED = frozenset(
    {Status.CREATED, Status.STOPPED, Status.KILLED, Status.FAILED, Status.FINISHED}
)

#: Lifecycle event published when a worker reaches a state (DESIGN.md §4).
EVENT_ON_ENTER: dict[Status, str] = {
    Status.CREATED: "created",
    Status.STARTING: "starting",
    Status.RUNNING: "started",
    Status.STOPPING: "stopping",
    Status.STOPPED: "stopped",
    Status.FAILED: "failed",
    Status.SUSPENDED: "suspended",
    Status.PENDING: "pending",
    Status.FINISHED: "finished",
    Status.KILLED: "killed",
    Status.DELETED: "deleted",
}

#: Who asks for a transition (recorded with it): the Python or HTTP API, the ``wm``
#: command, the circuit breaker, a schedule, or a node (a worker that cannot run there).
ACTORS = ("api", "cli", "breaker", "health", "schedule", "node")


def check_transition(worker_id: str, current: Status | str, target: Status | str) -> Status:
    """Return ``target`` as a Status if ``current → target`` is legal, else raise."""
    source, goal = Status(current), Status(target)
    if goal not in TRANSITIONS[source]:
        allowed = ", ".join(sorted(TRANSITIONS[source])) or "nothing (terminal state)"
        raise IllegalTransition(
            f"worker {worker_id} cannot go from {source} to {goal}; from {source} it may go to "
            f"{allowed}"
        )
    return goal


def check_actor(actor: str) -> str:
    """``actor`` if it is one of :data:`ACTORS`, else :class:`InvalidArgument`."""
    if actor not in ACTORS:
        raise InvalidArgument(f"actor {actor!r} is unknown: expected one of {', '.join(ACTORS)}")
    return actor
