"""``wm bench --scale-nodes 1,2,4,8``: the multi-node drain. For each count N, N plain Celery
nodes (``wm.bench.plainnodes``) and N WorkManager nodes (``wm.bench.nodes``), each of
``--concurrency`` processes, drain the same queue depth in turn, the two sides interleaved;
it prints events/s (steady-state window and full drain) and the scaling efficiency of each
side, rate(N) / (N × rate(1)) (relative to the smallest count when 1 is not asked for).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wm.bench import drain
from wm.bench.drainclock import AmqpProbe, Runs, Side, time_drain
from wm.bench.nodes import Nodes
from wm.bench.plainnodes import PlainNodes
from wm.bench.rig import SUCCEEDED_COMMAND, Rig
from wm.config import Settings

#: The WorkManager side's scenario: a stub worker with no output.
WM_SIDE = "no output"


def run(
    settings: Settings,
    home: Path,
    counts: Sequence[int],
    events: int,
    repeats: int,
    concurrency: int,
) -> dict[str, Any]:
    """Drain ``events`` per side and count, ``repeats`` times; print the table and return
    its figures."""
    with Rig(settings) as rig:
        results = measure(rig, home, counts, events, repeats, concurrency)
    report(results, events, repeats, concurrency, rig)
    return figures(results)


def measure(
    rig: Rig, home: Path, counts: Sequence[int], events: int, repeats: int, concurrency: int
) -> dict[int, tuple[Runs, Runs]]:
    """Each count's repetitions: the plain side's and WorkManager's."""
    idle = rig.queue("multi.idle")
    plain_queue = rig.name("multi.plain")
    worker = drain.worker_side(rig, [], WM_SIDE, "multi.nooutput", b"{}")
    results = {}
    for count in counts:
        place = home / f"multi-{count}"
        place.mkdir(exist_ok=True)
        with (
            Nodes(rig, place, count, concurrency, idle) as nodes,
            PlainNodes(rig.settings.broker_url, rig.prefix, place, count, concurrency) as plain,
        ):
            nodes.wait_consuming(2)
            sides = [drain.plain_side(rig, plain, plain_queue), _on(worker, rig, nodes)]
            plain.resume(plain_queue)
            for side in sides:
                side.fill(5)
            time.sleep(drain.WARM_UP_S)
            runs = (Runs(drain.PLAIN), Runs(WM_SIDE))
            for _ in range(repeats):
                for side, kept in zip(sides, runs, strict=True):
                    kept.timings.append(time_drain(side, events))
            results[count] = runs
    return results


def _on(side: Side, rig: Rig, nodes: Nodes) -> Side:
    """``side`` on these nodes: their processes, and on RabbitMQ the successes of all."""
    probe = side.probe
    if isinstance(probe, AmqpProbe):
        probe = AmqpProbe(rig.settings.broker_url, lambda: succeeded(rig, nodes.names))
    return Side(
        side.name,
        side.queue,
        side.fill,
        side.pause,
        side.resume,
        probe,
        lambda: list(nodes.pids),
        side.commands,
        side.info_calls,
    )


def succeeded(rig: Rig, names: list[str]) -> int:
    """Tasks the nodes ``names`` finished with success; raises unless all answer."""
    replies = rig.app.control.broadcast(
        SUCCEEDED_COMMAND, destination=names, reply=True, timeout=5.0, limit=len(names)
    )
    merged = {name: body for reply in replies or [] for name, body in reply.items()}
    if set(merged) != set(names):
        raise RuntimeError(f"nodes {sorted(set(names) - set(merged))} did not answer")
    return sum(int(body["succeeded"]) for body in merged.values())


def efficiency(rates: dict[int, float]) -> dict[int, float]:
    """rate(N) / (N / N0 × rate(N0)), N0 the smallest count."""
    base = min(rates)
    return {n: rate / (n / base * rates[base]) if rates[base] else 0.0 for n, rate in rates.items()}


def _medians(results: dict[int, tuple[Runs, Runs]], side: int, measure: str) -> dict[int, float]:
    return {n: statistics.median(getattr(runs[side], measure)) for n, runs in results.items()}


def report(
    results: dict[int, tuple[Runs, Runs]], events: int, repeats: int, concurrency: int, rig: Rig
) -> None:
    broker = "Redis" if rig.redis_broker else "RabbitMQ"
    print(
        f"\nMulti-node drain on {broker}: N nodes × {concurrency} processes per side, {events} "
        f"queued events, {repeats} repetitions interleaved; events/s median (window 80 % → "
        f"20 % left / full drain); efficiency = rate(N) / (N × rate(1)) on the window\n"
    )
    print(
        f"{'nodes':>5}  {'plain celery':>16}{'eff':>6}  {'wm ' + WM_SIDE:>16}{'eff':>6}"
        f"{'ratio':>8}  CPU ms/event plain / wm"
    )
    plain, wm = _medians(results, 0, "window"), _medians(results, 1, "window")
    plain_full, wm_full = _medians(results, 0, "full"), _medians(results, 1, "full")
    plain_eff, wm_eff = efficiency(plain), efficiency(wm)
    for n, runs in results.items():
        ratio = wm[n] / plain[n] if plain[n] else 0.0
        print(
            f"{n:>5}  {plain[n]:>7.0f} / {plain_full[n]:<6.0f}{plain_eff[n]:>6.2f}  "
            f"{wm[n]:>7.0f} / {wm_full[n]:<6.0f}{wm_eff[n]:>6.2f}{ratio:>7.2f}×  "
            f"{runs[0].median('cpu_ms'):.2f} / {runs[1].median('cpu_ms'):.2f}"
        )
    top = max(results)
    gap = plain_eff[top] - wm_eff[top]
    verdict = "met" if gap <= 0.1 else "MISSED"
    print(f"efficiency at {top} nodes: wm within 0.1 of plain celery's: {verdict} ({gap:+.2f})")


def figures(results: dict[int, tuple[Runs, Runs]]) -> dict[str, Any]:
    """The phase for ``wm bench --json``."""
    rows = []
    for side, name in ((0, drain.PLAIN), (1, WM_SIDE)):
        window, full = _medians(results, side, "window"), _medians(results, side, "full")
        eff = efficiency(window)
        for n in results:
            rows.append(
                {
                    "side": name,
                    "nodes": n,
                    "window_events_per_s": round(window[n], 1),
                    "full_events_per_s": round(full[n], 1),
                    "efficiency": round(eff[n], 3),
                }
            )
    return {"rows": rows}
