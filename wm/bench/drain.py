"""``wm bench --drain-repeats R``: the drain phase, WorkManager against an independent plain
Celery app. Each scenario's queue is filled while nothing consumes it, then consuming starts
and the clock runs until every message is acknowledged (``wm.bench.drainclock``): the full
drain and the steady-state window, Redis commands and node CPU per event.

The reference is a plain Celery app in its own process tree (``wm.bench.plainnodes``:
``acks_late``, prefetch multiplier 4, JSON, one prefork node of ``--concurrency``
processes, log level WARNING) on the same broker. WorkManager's side is its real node with
its defaults (``wm.bench.benchnode``, also at WARNING) running stub workers: no output, one
output, batched (the ``batch`` worker setting, where this build has it), a group, and the
workers on real engines ``wm bench`` is given. The bare ``wm.noop`` task on WorkManager's
own node is an extra line, not the reference. The scenarios run interleaved so a slow
stretch of the machine hits them all; ratios are taken within each repetition and their
spread printed.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kombu.transport.redis import PRIORITY_STEPS

from wm.bench.drainclock import AmqpProbe, Probe, RedisProbe, Runs, Side, time_drain
from wm.bench.dramatiqnodes import DRAMATIQ, DramatiqNode, DramatiqProbe
from wm.bench.plainnodes import PlainNodes
from wm.bench.rig import STUB, EngineWorker, Rig
from wm.config import Settings
from wm.dataplane.queues import subscription_queue, worker_queue_name
from wm.events import make_event
from wm.manager import WorkManager

#: Seconds the nodes have to consume every queue and load every engine before timing.
WARM_UP_S = 5.0
#: Targets of issue 26, as ratios of the plain Celery reference's rate (group: issue 12's).
TARGETS = {"no output": 1.0, "one output": 0.9, "batched": 3.0, "group": 0.7}
#: The reference's row, and the extra row of the bare task on WorkManager's own node.
PLAIN, WM_NOOP = "plain celery", "wm.noop, wm node"
#: The batched scenario's worker settings (batches are taken on a Redis broker only).
BATCHED = {"batch_size": 100}


def run(
    settings: Settings,
    home: Path,
    events: int,
    repeats: int,
    concurrency: int,
    engines: Sequence[EngineWorker] = (),
) -> dict[str, Any]:
    """Time the drain of ``events`` messages per scenario, ``repeats`` times; print it and
    return its figures."""
    with Rig(settings) as rig:
        header, results, notes = measure(rig, home, events, repeats, concurrency, engines)
        report(results, header, notes, events, repeats, rig)
    return figures(results, notes, events, repeats, concurrency)


def measure(
    rig: Rig,
    home: Path,
    events: int,
    repeats: int,
    concurrency: int,
    engines: Sequence[EngineWorker] = (),
) -> tuple[str, list[Runs], list[str]]:
    """How both sides run, each scenario's repetitions (the reference first) and notes
    (a scenario this build cannot run)."""
    noop = rig.queue("drain.bare")
    with (
        rig.node(home, concurrency, [noop]) as node,
        PlainNodes(rig.settings.broker_url, rig.prefix, home, 1, concurrency) as plain,
        ExitStack() as stack,
    ):
        sides, notes = _sides(rig, plain, [node.pid], noop, engines)
        header = f"{plain.describe()}\n{rig.describe_node()}"
        dramatiq, why_not = dramatiq_node(rig, home, concurrency)
        if dramatiq is None:
            notes.append(f"{DRAMATIQ}: {why_not}")
        else:
            sides.append(dramatiq_side(rig, stack.enter_context(dramatiq)))
            header += f"\n{dramatiq.describe()}"
        plain.resume(sides[0].queue)
        for side in sides:  # warm: consumers up, engines loaded
            side.fill(5)
        time.sleep(WARM_UP_S)
        results = {side.name: Runs(side.name) for side in sides}
        for _ in range(repeats):
            for side in sides:
                results[side.name].timings.append(time_drain(side, events))
    return header, list(results.values()), notes


def _sides(
    rig: Rig, plain: PlainNodes, pids: list[int], noop: str, engines: Sequence[EngineWorker]
) -> tuple[list[Side], list[str]]:
    out = rig.name("drain.out")
    rig.subscribe("drain.out", "sink")
    sides = [
        plain_side(rig, plain, rig.name("drain.plain")),
        worker_side(rig, pids, "no output", "drain.nooutput", b"{}"),
        worker_side(
            rig, pids, "one output", "drain.output", f'{{"output_type": "{out}"}}'.encode()
        ),
    ]
    notes = []
    if rig.redis_broker:
        sides.append(worker_side(rig, pids, "batched", "drain.batched", b"{}", settings=BATCHED))
    else:
        notes.append("batched: on a Redis broker only (RabbitMQ delivers one event per run)")
    sides.append(worker_side(rig, pids, "group", "drain.group", b"{}", group="drain"))
    for e in engines:
        sides.append(
            worker_side(rig, pids, e.name, f"drain.{e.suffix}", e.code, mime_type=e.mime_type)
        )
    sides.append(noop_side(rig, pids, noop))
    return sides, notes


def dramatiq_node(rig: Rig, home: Path, concurrency: int) -> tuple[DramatiqNode | None, str]:
    """The Dramatiq reference, where it can run: Dramatiq installed, a Redis broker."""
    if not rig.redis_broker:
        return None, "on a Redis broker only (the bench fills its Redis keys)"
    if importlib.util.find_spec("dramatiq") is None:
        return None, "not installed (pip install 'dramatiq[redis]', in the [dev] extra)"
    return DramatiqNode(rig.settings.broker_url, rig.prefix, home, concurrency), ""


def dramatiq_side(rig: Rig, node: DramatiqNode) -> Side:
    """The second reference: the Dramatiq node draining its queue."""
    return Side(
        DRAMATIQ,
        node.queue,
        node.fill,
        node.pause,
        node.resume,
        DramatiqProbe(node),
        lambda: node.pids,
        rig.redis_commands,
        rig.info_calls,
    )


def wm_probe(rig: Rig) -> Probe:
    """The end of a drain on WorkManager's node."""
    if not rig.redis_broker:
        return AmqpProbe(rig.settings.broker_url, rig.succeeded)
    options = rig.app.conf.broker_transport_options
    steps = options.get("priority_steps", PRIORITY_STEPS)
    return RedisProbe(rig.settings.broker_url, steps, str(options.get("unacked_key", "unacked")))


def plain_side(rig: Rig, plain: PlainNodes, queue: str) -> Side:
    """The reference: plain Celery nodes draining ``queue`` (kombu's default keys)."""
    url = rig.settings.broker_url
    probe: Probe = (
        RedisProbe(url, PRIORITY_STEPS) if rig.redis_broker else AmqpProbe(url, plain.succeeded)
    )
    return Side(
        PLAIN,
        queue,
        lambda count: plain.fill(queue, count),
        lambda: plain.pause(queue),
        lambda: plain.resume(queue),
        probe,
        lambda: plain.pids,
        rig.redis_commands,
        rig.info_calls,
    )


def worker_side(
    rig: Rig,
    pids: list[int],
    name: str,
    suffix: str,
    code: bytes,
    group: str | None = None,
    mime_type: str = STUB,
    settings: Mapping[str, Any] | None = None,
) -> Side:
    """A worker's queue (a stub's by default) on WorkManager's node(s) ``pids``, paused by
    stopping the worker."""
    info = rig.worker(suffix, code, group, mime_type, settings)
    manager = rig.manager
    return Side(
        name,
        worker_queue_name(info.topic, str(info.id)),
        lambda count: publish(manager, info.topic, count),
        lambda: manager.stop_worker(info.id),
        lambda: manager.start_worker(info.id),
        wm_probe(rig),
        lambda: pids,
        rig.redis_commands,
        rig.info_calls,
    )


def noop_side(rig: Rig, pids: list[int], queue: str) -> Side:
    """The bare ``wm.noop`` task on WorkManager's own node: an extra line, not the reference."""
    return Side(
        WM_NOOP,
        queue,
        lambda count: send_bare(rig, queue, count),
        lambda: rig.pause(queue),
        lambda: rig.resume(queue),
        wm_probe(rig),
        lambda: pids,
        rig.redis_commands,
        rig.info_calls,
    )


def publish(manager: WorkManager, topic: str, count: int) -> None:
    """``count`` events to ``topic`` (the .NET bench worker's command included)."""
    for n in range(count):
        manager.publish(make_event(topic, "/bench", {"n": n, "command": "echo"}))


def send_bare(rig: Rig, queue_name: str, count: int) -> None:
    """``count`` bare Celery tasks that do nothing, to ``queue_name``."""
    queue = subscription_queue(queue_name)
    with rig.app.producer_or_acquire() as producer:
        for _ in range(count):
            rig.app.send_task("wm.noop", queue=queue, producer=producer)


def ratios(result: Runs, plain: Runs, measure: str) -> list[float]:
    """``result``'s rate over the reference's, repetition by repetition."""
    pairs = zip(getattr(result, measure), getattr(plain, measure), strict=True)
    return [rate / reference if reference else 0.0 for rate, reference in pairs]


def report(
    results: list[Runs], header: str, notes: list[str], events: int, repeats: int, rig: Rig
) -> None:
    plain = results[0]
    broker = "Redis" if rig.redis_broker else "RabbitMQ"
    events_on = "on" if rig.settings.task_events else "off"
    print(
        f"\nDrain on {broker}: {events} queued events per scenario, {repeats} repetitions "
        f"interleaved, task events {events_on}; full drain, and the steady-state window "
        f"(80 % → 20 % of the queue left); ratios to {PLAIN}, median [spread]\n{header}\n"
    )
    print(
        f"{'scenario':<18}{'full events/s':>14}{'ratio':>8}{'':<14}{'window events/s':>16}"
        f"{'ratio':>8}{'':<14}{'cmds/event':>11}{'CPU ms/event':>13}"
    )
    for result in results:
        print(_row(result, plain))
    for note in notes:
        print(note)
    for measure, ratio in against_dramatiq(results).items():
        verdict = "met" if ratio > 1.0 else "MISSED"
        print(f"batched / {DRAMATIQ}, {measure}: {ratio:.2f}× (target: ahead, > 1×): {verdict}")
    print(f"({WM_NOOP}: the bare task on WorkManager's own node, for comparison only)")


def against_dramatiq(results: list[Runs]) -> dict[str, float]:
    """The batched scenario's rate over Dramatiq's, full drain and window (medians of the
    repetitions' ratios); empty unless both ran."""
    found = {result.name: result for result in results}
    if "batched" not in found or DRAMATIQ not in found:
        return {}
    batched, dramatiq = found["batched"], found[DRAMATIQ]
    return {
        measure: statistics.median(ratios(batched, dramatiq, measure))
        for measure in ("full", "window")
    }


def _row(result: Runs, plain: Runs) -> str:
    cells = [f"{result.name:<18}"]
    verdicts = []
    for measure in ("full", "window"):
        rate = statistics.median(getattr(result, measure))
        spread = ratios(result, plain, measure)
        ratio = statistics.median(spread)
        cells.append(f"{rate:>14.0f}{ratio:>7.2f}× [{min(spread):.2f}–{max(spread):.2f}]")
        target = TARGETS.get(result.name)
        if target is not None:
            missed = f"MISSED ({ratio:.3f}×)"  # the table's two decimals may round up to it
            verdicts.append(f"{measure} " + ("met" if ratio >= target else missed))
    cells.append(f"{result.median('commands'):>11.1f}{result.median('cpu_ms'):>13.2f}")
    target = TARGETS.get(result.name)
    if target is not None:
        cells.append(f"  target ≥ {target}×: {', '.join(verdicts)}")
    return "".join(cells)


def figures(
    results: list[Runs], notes: list[str], events: int, repeats: int, concurrency: int
) -> dict[str, Any]:
    """The phase for ``wm bench --json``."""
    plain = results[0]
    rows = []
    for result in results:
        row: dict[str, Any] = {"scenario": result.name}
        for measure in ("full", "window"):
            row[f"{measure}_events_per_s"] = round(statistics.median(getattr(result, measure)), 1)
            row[f"{measure}_ratio"] = round(statistics.median(ratios(result, plain, measure)), 3)
        row["commands_per_event"] = round(result.median("commands"), 2)
        row["cpu_ms_per_event"] = round(result.median("cpu_ms"), 3)
        row["target"] = TARGETS.get(result.name)
        rows.append(row)
    return {
        "events": events,
        "repeats": repeats,
        "concurrency": concurrency,
        "scenarios": rows,
        "batched_vs_dramatiq": {k: round(v, 3) for k, v in against_dramatiq(results).items()},
        "notes": notes,
    }
