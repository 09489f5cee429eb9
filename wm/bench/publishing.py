"""The publish phase of ``wm bench`` (``--publish-events N``): events/s from one process for a
bare Celery ``send_task``, ``WorkManager.publish`` and ``WorkManager.publish_many``, on the
same broker, in interleaved rounds (the machine's noise falls on all three alike), with the
ratios to the targets: ``publish`` at least half a bare ``send_task``, and ``publish_many``
at least 20,000 events/s on Redis.

WorkManager's side publishes to a topic with one stub worker (a routes lookup, a ledger
entry and a task message per event); the bare side sends one task message per event to a
queue of its own. No node runs: the phase times the publisher alone, and deletes the queues
and what they hold when it ends.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from wm.bench.rig import Rig
from wm.config import Settings
from wm.dataplane.app import celery_settings
from wm.events import CloudEvent, make_event

#: ``publish`` / bare ``send_task`` the issue asks for, and ``publish_many``'s events/s.
PUBLISH_RATIO_TARGET = 0.5
PUBLISH_MANY_TARGET_PER_S = 20_000
#: The bare reference's task name: no node runs it, only its messages are timed.
BARE_TASK = "wm.bench.bare_publish"


def run(settings: Settings, events: int, repeats: int) -> dict[str, Any]:
    """Time the three publishers ``repeats`` times each, interleaved; prints a table and
    returns the medians (events/s) and ratios."""
    with Rig(settings) as rig:
        topic = rig.name("publish")
        rig.worker("publish", b"{}")
        bare_queue = rig.queue("bare")
        bare = _bare_app(settings)
        batches = [_events(topic, events, n) for n in range(repeats * 2 + 1)]
        sides: dict[str, Callable[[int], Any]] = {
            "bare send_task": lambda _: _send_bare(bare, bare_queue, events),
            "publish": lambda n: _publish_each(rig, batches[n]),
            "publish_many": lambda n: rig.manager.publish_many(batches[n + repeats]),
        }
        sides["publish"](repeats * 2)  # warm-up: connections, scripts, queue declares
        rates: dict[str, list[float]] = {name: [] for name in sides}
        for n in range(repeats):
            for name, side in sides.items():
                started = time.perf_counter()
                side(n)
                rates[name].append(events / (time.perf_counter() - started))
        rig.manager.bus.delete_queue(bare_queue)
    return _report(rates, settings.broker_url)


def _bare_app(settings: Settings) -> Celery:
    """A plain Celery app on the same broker with WorkManager's publishing settings."""
    conf = celery_settings(settings)
    app = Celery("wm-bench-bare", set_as_current=False)
    app.conf.update(
        broker_url=settings.broker_url,
        broker_transport_options={"confirm_publish": True},
        task_ignore_result=True,
        task_serializer="json",
        task_default_delivery_mode=conf.get("task_default_delivery_mode", "persistent"),
    )
    return app


def _events(topic: str, count: int, round_: int) -> list[CloudEvent]:
    return [make_event(topic, "/bench", {"n": n}, id=f"r{round_}-{n}") for n in range(count)]


def _send_bare(app: Celery, queue: str, count: int) -> None:
    for n in range(count):
        app.send_task(BARE_TASK, args=[n], queue=queue)


def _publish_each(rig: Rig, events: list[CloudEvent]) -> None:
    for event in events:
        rig.manager.publish(event)


def _report(rates: dict[str, list[float]], broker_url: str) -> dict[str, Any]:
    medians = {name: statistics.median(found) for name, found in rates.items()}
    bare = medians["bare send_task"]
    ratio = medians["publish"] / bare if bare else 0.0
    many = medians["publish_many"]
    redis = broker_url.startswith(("redis://", "rediss://"))
    print("\npublish phase: events/s from one process (median of the rounds)")
    for name, rate in medians.items():
        print(f"  {name:<16} {rate:>10,.0f}/s   x{rate / bare if bare else 0:.2f} bare")
    verdict = "meets" if ratio >= PUBLISH_RATIO_TARGET else "misses"
    print(f"  publish / bare send_task = {ratio:.2f} ({verdict} the target {PUBLISH_RATIO_TARGET})")
    if redis:
        verdict = "meets" if many >= PUBLISH_MANY_TARGET_PER_S else "misses"
        print(
            f"  publish_many {many:,.0f}/s = {many / PUBLISH_MANY_TARGET_PER_S:.2f} of the "
            f"target {PUBLISH_MANY_TARGET_PER_S:,}/s ({verdict} it)"
        )
    return {
        "events_per_s": {name: round(rate, 1) for name, rate in medians.items()},
        "publish_ratio": round(ratio, 3),
        "publish_many_ratio": round(many / bare, 3) if bare else 0.0,
    }
