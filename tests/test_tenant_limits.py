"""Per-tenant limits and the fair share between tenants (docs/guides/tenants.md):
limits stored, checked and shown; ``max_workers`` refused without overshoot under concurrent
creations; ``max_concurrency`` and ``rate_limit`` held across real nodes, their waits no
failures; a tenant without limits as before; and a noisy neighbour that floods 10,000
events while another tenant's trickle keeps its latency."""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection

from tests.conftest import env_of
from tests.helpers import STUB, drain, eventually, free_port, scrape, stub, wm_cli
from wm import InvalidArgument, Settings, TenantLimitReached, TenantNotFound, WorkManager
from wm.dataplane.fairshare import FairBuffer
from wm.events import make_event
from wm.state.connection import redis_for
from wm.state.directory import Directory


def _cli_error(settings: Settings, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "wm.cli", *args],
        env=env_of(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0, result.stdout
    return result.stderr


def test_limits_are_checked_stored_shown_and_changed(settings: Settings) -> None:
    manager = WorkManager(settings)
    made = manager.create_tenant("acme", max_concurrency=4, rate_limit=2.5)
    assert made.limits.to_json() == {"max_concurrency": 4, "rate_limit": 2.5, "max_workers": None}
    bad = [
        ({"max_concurrency": 0}, "max_concurrency must be at least 1, not 0"),
        ({"max_workers": -1}, "max_workers must be at least 0"),
        ({"rate_limit": 0}, "rate_limit must be above 0"),
        ({"rate_limit": float("inf")}, "rate_limit must be above 0"),
        ({"max_concurrency": 1.5}, "max_concurrency must be a whole number"),
        ({"max_concurrency": True}, "max_concurrency must be a whole number"),
        ({"rate_limit": "fast"}, "rate_limit must be a number"),
        ({"max_things": 1}, "unknown tenant limit max_things; known: max_concurrency"),
    ]
    for given, says in bad:
        with pytest.raises(InvalidArgument, match=says):
            manager.set_tenant_limits("acme", **given)
    with pytest.raises(InvalidArgument, match="max_concurrency must be at least 1"):
        manager.create_tenant("beta", max_concurrency=0)
    with pytest.raises(InvalidArgument, match="give at least one limit"):
        manager.set_tenant_limits("acme")
    with pytest.raises(TenantNotFound, match="no tenant 'nope'"):
        manager.set_tenant_limits("nope", max_workers=1)
    changed = manager.set_tenant_limits("acme", max_concurrency=None, max_workers=2)
    assert changed.limits.to_json() == {
        "max_concurrency": None,
        "rate_limit": 2.5,
        "max_workers": 2,
    }
    listed = {t.name: t.limits.to_json() for t in manager.list_tenants()}
    assert listed["default"] == {"max_concurrency": None, "rate_limit": None, "max_workers": None}
    assert listed["acme"] == changed.limits.to_json()
    # the command line: the same checks, 'none' for unlimited
    made_cli = wm_cli(settings, "tenant", "create", "gamma", "--rate-limit", "10")
    assert made_cli["limits"]["rate_limit"] == 10.0
    shown = wm_cli(settings, "tenant", "set", "gamma", "--rate-limit", "none", "--max-workers", "3")
    assert shown["limits"] == {"max_concurrency": None, "rate_limit": None, "max_workers": 3}
    assert "max_concurrency must be at least 1, not 0" in _cli_error(
        settings, "tenant", "set", "gamma", "--max-concurrency", "0"
    )
    assert "must be a whole number or 'none'" in _cli_error(
        settings, "tenant", "create", "delta", "--max-workers", "many"
    )
    table = subprocess.run(
        [sys.executable, "-m", "wm.cli", "tenant", "list"],
        env=env_of(settings),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "MAX_CONCURRENCY" in table and "RATE_LIMIT" in table


def test_max_workers_is_refused_and_concurrent_creations_never_overshoot(
    pg_settings: Settings,
) -> None:
    manager = WorkManager(pg_settings)
    manager.create_tenant("acme", max_workers=3)
    acme = WorkManager(pg_settings, tenant="acme")

    def create(n: int) -> str:
        try:
            acme.create_worker(code=stub(), mime_type=STUB, topic=f"t{n}", start=False)
        except TenantLimitReached as exc:
            return str(exc)
        return "created"

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(create, range(8)))
    assert results.count("created") == 3, results
    refusal = next(r for r in results if r != "created")
    assert "tenant 'acme' has 3 live workers, its max_workers limit is 3" in refusal
    assert [t.workers for t in manager.list_tenants() if t.name == "acme"] == [3]
    acme.delete_worker(acme.list_workers()[0].id)  # a deleted worker frees its place
    acme.create_worker(code=stub(), mime_type=STUB, topic="again", start=False)
    manager.create_worker(code=stub(), mime_type=STUB, topic="t", start=False)  # default: none


def _runs(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    return sorted((e["data"]["started_at"], e["data"]["finished_at"]) for e in events)


def _most_at_once(runs: list[tuple[float, float]]) -> int:
    edges = sorted([(start, 1) for start, _ in runs] + [(end, -1) for _, end in runs])
    running, most = 0, 0
    for _, step in edges:  # an end sorts before a start at the same instant
        running += step
        most = max(most, running)
    return most


def _running(manager: WorkManager) -> Any:
    """The tenant's line of ``wm status`` once two of its deliveries run."""
    found = [t for t in manager.status().tenants if t.name == manager.tenant]
    return found[0] if found and found[0].in_flight == 2 else None


def _trace_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_max_concurrency_holds_across_two_nodes_and_waits_are_no_failures(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """Two workers of one tenant on two nodes of two processes each could run four at once;
    the tenant allows two. Waiting uses no attempt and parks nothing."""
    WorkManager(pg_settings).create_tenant("acme", max_concurrency=2)
    acme = WorkManager(pg_settings, tenant="acme")
    out = acme.subscribe("cap.done", "out")
    trace = tmp_path / "runs.jsonl"
    code = stub(output_type="cap.done", sleep_ms=300, trace=str(trace))
    workers = [acme.create_worker(code=code, mime_type=STUB, topic=f"cap{i}") for i in range(2)]
    ports = [free_port(), free_port()]  # each node's metrics
    nodes = [
        start_node(pg_settings.replace(health_port=port), name=f"n{i}")
        for i, port in enumerate(ports)
    ]
    for node in nodes:
        for i, worker in enumerate(workers):
            node.consuming(f"acme::cap{i}::{worker.id}")
    for n in range(6):
        for i in range(2):
            acme.publish(make_event(f"cap{i}", "/t", {"n": n}))
    shown = eventually(lambda: _running(acme), timeout_s=30)  # wm status, while they run
    assert (shown.in_flight, shown.limits.max_concurrency) == (2, 2)
    runs = _runs(drain(pg_settings, out, 12, timeout_s=60))
    assert len(runs) == 12
    assert _most_at_once(runs) == 2, runs
    tenant = (("tenant", "acme"),)
    # A delivery publishes its output inside its run: the last output can arrive just before
    # the run ends and the node's in-flight gauge goes back to 0.
    deadline = time.monotonic() + 15
    while True:
        scraped = [scrape(f"http://127.0.0.1:{port}/metrics") for port in ports]
        in_flight = [samples.get(("wm_tenant_in_flight", tenant), 0) for samples in scraped]
        if in_flight == [0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert in_flight == [0, 0], f"still in flight 15 s after the last output: {in_flight}"
    for samples in scraped:
        assert samples[("wm_tenant_limit", (("limit", "max_concurrency"), *tenant))] == 2
    assert sum(s.get(("wm_tenant_throttled_total", tenant), 0) for s in scraped) > 0
    assert acme.dead_letters.list() == []
    assert _trace_lines(trace) == 12  # each event ran once: a wait is no attempt
    assert redis_for(pg_settings).zcard("wm:tenant-slots:{acme}") == 0  # every slot freed


@pytest.mark.slow
def test_rate_limit_holds_and_reaches_running_workers(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """A tenant limited to 10 events/s (a burst of 10) while its worker runs: deliveries
    begun in any span of ``L`` seconds are at most ``10 + 10·L``; all run, none parked."""
    manager = WorkManager(pg_settings)
    manager.create_tenant("acme")
    acme = WorkManager(pg_settings, tenant="acme")
    out = acme.subscribe("rl.done", "out")
    trace = tmp_path / "runs.jsonl"
    worker = acme.create_worker(
        code=stub(output_type="rl.done", trace=str(trace)), mime_type=STUB, topic="rl"
    )
    node = start_node(pg_settings)
    node.consuming(f"acme::rl::{worker.id}")
    acme.publish(make_event("rl", "/t", {"n": -1}))
    assert len(drain(pg_settings, out, 1)) == 1  # the worker's facts cached without a limit
    manager.set_tenant_limits("acme", rate_limit=10)
    acme.publish_many([make_event("rl", "/t", {"n": n}) for n in range(40)])
    starts = sorted(r[0] for r in _runs(drain(pg_settings, out, 40, timeout_s=60)))
    assert len(starts) == 40
    slack_s = 0.05  # the stub's clock reads a little after Redis admitted the delivery
    for i in range(len(starts)):
        for j in range(i + 1, len(starts)):
            assert j - i + 1 <= 10 + 10 * (starts[j] - starts[i] + slack_s) + 1, (i, j, starts)
    assert starts[-1] - starts[0] >= (40 - 10) / 10 - 0.2
    assert acme.dead_letters.list() == []
    assert _trace_lines(trace) == 41
    shown = subprocess.run(
        [sys.executable, "-m", "wm.cli", "status"],
        env=env_of(pg_settings),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    [line] = [row for row in shown.splitlines() if row.startswith("acme ")]
    workers, in_flight, rate, max_workers = line.split()[1:]
    assert (workers, in_flight, max_workers) == ("1", "0/-", "-"), shown  # nothing runs now
    begun, limit = rate.split("/")  # begun in the last whole second, of the rate
    assert limit == "10" and int(begun) <= 10 + 10, shown


@pytest.mark.slow
def test_a_tenant_without_limits_costs_nothing_and_runs_as_before(
    pg_settings: Settings, start_node: Any
) -> None:
    """Every setting at its default: the worker's cached facts are as before limits existed
    and no tenant-limit key is ever written."""
    WorkManager(pg_settings).create_tenant("acme")
    by = {"acme": WorkManager(pg_settings, tenant="acme"), "default": WorkManager(pg_settings)}
    node = start_node(pg_settings)
    outs = {}
    for tenant, manager in by.items():
        outs[tenant] = manager.subscribe("d.done", "out")
        worker = manager.create_worker(
            code=stub(output_type="d.done", sleep_ms=50), mime_type=STUB, topic="d"
        )
        prefix = "" if tenant == "default" else f"{tenant}::"
        node.consuming(f"{prefix}d::{worker.id}")
        for n in range(4):
            manager.publish(make_event("d", "/t", {"n": n}))
        assert len(drain(pg_settings, outs[tenant], 4)) == 4
        cached = redis_for(pg_settings).get(f"wm:worker:{{{worker.id}}}")
        assert cached is not None and "tenant_limits" not in json.loads(cached)
        assert Directory(pg_settings).get(str(worker.id)).tenant_limits is None  # type: ignore[union-attr]
        assert manager.dead_letters.list() == []
    assert list(redis_for(pg_settings).scan_iter(match="wm:tenant-*")) == []


class _Receiver(threading.Thread):
    """Reads a plain subscription's events as they arrive: ``arrived[n]`` is when the output
    of input ``n`` was read."""

    def __init__(self, settings: Settings, queue: str) -> None:
        super().__init__(daemon=True)
        self.settings, self.queue = settings, queue
        self.arrived: dict[int, float] = {}
        #: ``started[n]``: when the worker's code began on input ``n``.
        self.started: dict[int, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        with Connection(self.settings.broker_url) as conn:
            simple = conn.SimpleQueue(self.queue)
            while not self.stop.is_set():
                try:
                    message = simple.get(timeout=0.2)
                except simple.Empty:
                    continue
                data = json.loads(message.body)["data"]
                self.arrived[data["input"]["n"]] = time.time()
                self.started[data["input"]["n"]] = data["started_at"]
                message.ack()


def _trickle(manager: WorkManager, receiver: _Receiver, first: int, count: int) -> list[float]:
    """Publish ``count`` events 30 ms apart; each one's publish-to-output latency (s)."""
    sent: dict[int, float] = {}
    for n in range(first, first + count):
        sent[n] = time.time()
        manager.publish(make_event("ping", "/b", {"n": n}))
        time.sleep(0.03)
    deadline = time.monotonic() + 60
    while not all(n in receiver.arrived for n in sent) and time.monotonic() < deadline:
        time.sleep(0.05)
    got = [n for n in sent if n in receiver.arrived]
    return [receiver.arrived[n] - sent[n] for n in got]


#: Events tenant ``a`` floods first (WM_TEST_FLOOD to measure with fewer or more); doubled
#: for the next trial when the node drained them before ``b``'s trickle ended (a fast host).
FLOOD = int(os.environ.get("WM_TEST_FLOOD", "10000"))
#: Events of tenant ``b``'s trickle, idle and flooded: enough that the p99 is no maximum
#: (two of them may be slower), which one scheduling hiccup of a shared machine would set.
TRICKLE = 200
#: Floods tried at most: one whose p99 a stall of the shared machine spoilt is tried again,
#: and so is one the node drained too soon (without the fair share every trial misses the
#: bound: 34-45 ms against 13-15 ms idle).
FLOOD_TRIALS = 4


def _p99(latencies: list[float]) -> float:
    if len(latencies) < 2:
        return float("inf")
    return statistics.quantiles(latencies, n=100, method="inclusive")[98]


def _median(latencies: list[float]) -> float:
    return statistics.median(latencies) if latencies else float("inf")


@pytest.mark.slow
@pytest.mark.alone
def test_a_noisy_neighbour_does_not_delay_another_tenant_beyond_its_share(
    pg_settings: Settings, start_node: Any
) -> None:
    """Tenant ``a`` floods 10,000 events (or more, on a host fast enough to drain them before
    the trickle ends) over four workers; tenant ``b`` publishes a trickle to one. ``b``'s p99
    publish-to-output latency stays within 2x its value measured idle, in the same test, on
    the same node; ``a``'s flood is all delivered."""
    manager = WorkManager(pg_settings)
    for name in ("a", "b"):
        manager.create_tenant(name)
    a, b = WorkManager(pg_settings, tenant="a"), WorkManager(pg_settings, tenant="b")
    pongs = b.subscribe("pong", "sink")
    floods = [a.create_worker(code=stub(), mime_type=STUB, topic=f"f{i}") for i in range(4)]
    pinger = b.create_worker(code=stub(output_type="pong"), mime_type=STUB, topic="ping")
    node = start_node(pg_settings)
    for i, worker in enumerate(floods):
        node.consuming(f"a::f{i}::{worker.id}")
    node.consuming(f"b::ping::{pinger.id}")
    receiver = _Receiver(pg_settings, pongs)
    receiver.start()
    _trickle(b, receiver, 0, 10)  # warm: engines loaded, facts cached

    reports, flood, outlasted = [], FLOOD, False
    for trial in range(1, FLOOD_TRIALS + 1):  # a CPU stall of a shared machine is no unfairness
        # b idle right before each flood: a drift of the shared machine weighs on both alike
        eventually(lambda: _backlog(a) == 0, timeout_s=300)
        idle = _trickle(b, receiver, 1000 * trial + 500, TRICKLE)
        busy, report, outlasted = _flooded(a, b, receiver, idle, flood, first=1000 * trial)
        reports.append(report)
        if not outlasted:  # a node fast enough to drain it amid the trickle: b was not flooded
            flood *= 2
        elif _p99(busy) <= 2 * _p99(idle):
            break
    eventually(lambda: _backlog(a) == 0, timeout_s=300)  # and a's flood is all delivered
    receiver.stop.set()
    print("\n".join(reports))
    assert outlasted, f"the last flood did not outlast b's trickle: {reports}"
    assert _p99(busy) <= 2 * _p99(idle), reports


def _backlog(a: WorkManager) -> int:
    return sum(s["depth"] for s in a.list_subscriptions() if s["topic"].startswith("f"))


def _flooded(
    a: WorkManager, b: WorkManager, receiver: Any, idle: list[float], flood: int, first: int
) -> tuple[list[float], str, bool]:
    """``a`` floods ``flood`` events, then ``b`` trickles: ``b``'s latencies, a report, and
    whether the flood outlasted the trickle (a backlog left when it ended)."""
    began = time.monotonic()
    for start in range(0, flood, 500):  # published before b's trickle: the test's own
        # publishing and b's share one interpreter, whose lock would add to b's latency
        a.publish_many(
            [make_event(f"f{(start + k) % 4}", "/a", {"n": start + k}) for k in range(500)]
        )
    published_s = time.monotonic() - began
    gc.collect()  # the flood's events are garbage: not collected amid b's trickle
    time.sleep(0.5)
    busy = _trickle(b, receiver, first, TRICKLE)
    backlog = _backlog(a)
    report = (
        f"idle p99 {_p99(idle) * 1000:.1f} ms (median {_median(idle) * 1000:.1f}), "
        f"flooded p99 {_p99(busy) * 1000:.1f} ms (median {_median(busy) * 1000:.1f}), "
        f"a's {flood} published in {published_s:.1f} s, "
        f"its backlog {backlog} after {time.monotonic() - began:.1f} s, "
        f"b's outputs {len(busy)}/{TRICKLE} flooded, its slowest "
        f"{[round(x * 1000) for x in sorted(busy)[-4:]]} ms"
    )
    assert len(idle) == TRICKLE and len(busy) == TRICKLE, report
    return busy, report, backlog > 0


class _Request:
    def __init__(self, queue: str) -> None:
        self.delivery_info = {"routing_key": queue}

    def on_accepted(self) -> None:
        """What Celery's request gives the pool job as its accept callback."""


class _Job:
    def __init__(self, queue: str, n: int) -> None:
        self._accept_callback = _Request(queue).on_accepted
        self.n = n


def test_the_node_hands_its_pool_processes_the_tenants_messages_in_turn() -> None:
    """``FairBuffer``: one tenant's order is Celery's (first in, first out); a second
    tenant's message goes next, whatever the first has buffered, and the node is told the
    tenants compete (a shallow prefetch) and, once the second is quiet, that one is left."""
    told: list[bool] = []
    buffer = FairBuffer(active_s=0.3)
    buffer.on_crowded = told.append
    for n in range(4):
        buffer.append(_Job(f"a::f{n % 2}::w{n % 2}", n))
    buffer.append(_Job("wm.default", 50))  # a control task: the default tenant's turn
    assert told == [] and len(buffer) == 5
    buffer.append(_Job("b::ping::w", 99))
    buffer.append(_Job("ping::w", 77))  # the default tenant's worker queue
    assert told == [True]
    assert [buffer.popleft().n for _ in range(3)] == [0, 50, 99]
    buffer.appendleft(_Job("b::ping::w", 98))  # put back: first again
    assert [buffer.popleft().n for _ in range(5)] == [98, 1, 77, 2, 3]
    assert not buffer and len(buffer) == 0
    time.sleep(0.4)
    buffer.append(_Job("a::f0::w0", 5))
    assert told == [True, False] and buffer.popleft().n == 5
    with pytest.raises(IndexError):
        buffer.popleft()
