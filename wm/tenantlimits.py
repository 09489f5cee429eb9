"""A tenant's limits (issue 28, point 4; docs/guides/tenants.md), checked here and
stored on its row (``wm.store.models.Tenant``); None is unlimited, the default of each.

- ``max_concurrency``: deliveries of the tenant's workers running at once, across the
  cluster (``wm.state.tenantlimits``);
- ``rate_limit``: deliveries begun per second, across the cluster, with a burst of one
  second's worth;
- ``max_workers``: live (not deleted) workers, checked when one is created.

The first two are the data plane's: a node reads them with the worker's facts
(``wm.state.directory.WorkerMeta.tenant_limits``), so a tenant without them costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from wm.errors import InvalidArgument

#: The limits by name, in the order they are shown.
NAMES = ("max_concurrency", "rate_limit", "max_workers")
#: The limits a node enforces on every delivery (``max_workers`` is the control plane's).
DELIVERY_LIMITS = ("max_concurrency", "rate_limit")
#: The highest rate accepted (events/s): beyond it a limit limits nothing a node can reach.
MAX_RATE = 1_000_000.0
#: Words that mean "no limit" where a value is given as text (the CLI).
UNLIMITED_WORDS = ("none", "unlimited")


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits; None: unlimited."""

    max_concurrency: int | None = None
    rate_limit: float | None = None
    max_workers: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def delivery(self) -> dict[str, Any] | None:
        """The limits a node enforces, those set only; None when there are none (the
        worker's facts then carry nothing, and the delivery pays nothing)."""
        given = {name: getattr(self, name) for name in DELIVERY_LIMITS}
        given = {name: value for name, value in given.items() if value is not None}
        return given or None

    def changed(self, given: Mapping[str, object]) -> TenantLimits:
        """These limits with ``given`` (checked) in place of theirs."""
        return TenantLimits(**{**asdict(self), **check_limits(given)})

    def shown(self, name: str) -> str:
        value = getattr(self, name)
        return "-" if value is None else f"{value:g}"


def check_limits(given: Mapping[str, object]) -> dict[str, int | float | None]:
    """``given`` checked: known names only, each None (unlimited) or a value in range;
    :class:`InvalidArgument` names the limit and the rule broken."""
    unknown = sorted(set(given) - set(NAMES))
    if unknown:
        raise InvalidArgument(
            f"unknown tenant limit {', '.join(unknown)}; known: {', '.join(NAMES)}"
        )
    return {name: _checked(name, value) for name, value in given.items()}


def _checked(name: str, value: object) -> int | float | None:
    if value is None:
        return None
    if name == "rate_limit":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidArgument(f"tenant limit rate_limit must be a number, not {value!r:.40}")
        if not math.isfinite(value) or not 0 < value <= MAX_RATE:
            raise InvalidArgument(
                f"tenant limit rate_limit must be above 0 and at most {MAX_RATE:g} events/s, "
                f"not {value!r}"
            )
        return float(value)
    lowest = 0 if name == "max_workers" else 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"tenant limit {name} must be a whole number, not {value!r:.40}")
    if value < lowest:
        raise InvalidArgument(f"tenant limit {name} must be at least {lowest}, not {value}")
    return value


def parse_limit(name: str, text: str) -> int | float | None:
    """A limit given as text (``none`` or ``unlimited``: no limit), checked."""
    if text.strip().lower() in UNLIMITED_WORDS:
        return None
    try:
        value: int | float = float(text) if name == "rate_limit" else int(text)
    except ValueError:
        kind = "a number" if name == "rate_limit" else "a whole number"
        raise InvalidArgument(
            f"tenant limit {name} must be {kind} or 'none' (unlimited), not {text!r:.40}"
        ) from None
    return check_limits({name: value})[name]
