"""A real prefork node's ``/metrics``, scraped as Prometheus would: the per-worker counters
move by exactly the deliveries made (their pool processes' samples added up by the main
process), the histograms count each run, and the node's own gauges are there; the samples'
directory an operator names is emptied when a node starts and by nothing else, and a pool
process killed outright stops counting in the node's gauges while its counts stay."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT, env_of
from tests.helpers import STUB, doc, drain, eventually, free_port, scrape, stub
from wm import Settings, WorkManager, make_event
from wm.ops import clustermetrics, metrics

GOOD_EVENTS, BAD_EVENTS = 7, 3


def _of(samples: dict[Any, float], name: str, worker: Any) -> float:
    key = (name, (("tenant", "default"), ("worker", worker.name), ("worker_id", str(worker.id))))
    return samples.get(key, 0.0)


@pytest.mark.slow
def test_counters_move_by_exactly_the_deliveries_made(
    pg_settings: Settings, start_node: Any
) -> None:
    port = free_port()
    settings = pg_settings.replace(health_port=port)
    manager = WorkManager(settings)
    sink = manager.subscribe("metered.out", "sink")
    good = manager.create_worker(
        code=stub(output_type="metered.out"), mime_type=STUB, topic="metered.in", name="good"
    )
    bad = manager.create_worker(
        code=stub(fail="boom"),
        mime_type=STUB,
        topic="metered.bad",
        name="bad",
        # every attempt fails: the breaker (on by default) would pause it before all are parked
        settings={"max_retries": 1, "retry_base_delay_ms": 10, "failure_threshold": 0},
    )
    node = start_node(settings, name="metrics")
    node.consuming(f"metered.in::{good.id}")
    node.consuming(f"metered.bad::{bad.id}")
    url = f"http://127.0.0.1:{port}/metrics"
    before = scrape(url)
    assert _of(before, "wm_delivered_total", good) == 0

    for n in range(GOOD_EVENTS):
        manager.publish(make_event("metered.in", "/tests", {"n": n}))
    for n in range(BAD_EVENTS):
        manager.publish(make_event("metered.bad", "/tests", {"n": n}))
    assert len(drain(settings, sink, GOOD_EVENTS, timeout_s=30)) == GOOD_EVENTS

    def settled() -> dict[Any, float] | None:
        samples = scrape(url)
        done = _of(samples, "wm_succeeded_total", good) >= GOOD_EVENTS
        parked = _of(samples, "wm_dead_lettered_total", bad) >= BAD_EVENTS
        return samples if done and parked else None

    eventually(settled, timeout_s=30)
    time.sleep(1.0)  # anything counted twice would show now
    samples = scrape(url)
    expected = {
        ("wm_delivered_total", "good"): GOOD_EVENTS,
        ("wm_succeeded_total", "good"): GOOD_EVENTS,
        ("wm_failed_total", "good"): 0,
        ("wm_engine_seconds_count", "good"): GOOD_EVENTS,
        ("wm_publish_to_output_seconds_count", "good"): GOOD_EVENTS,
        ("wm_delivered_total", "bad"): 2 * BAD_EVENTS,  # each event: the attempt, one retry
        ("wm_failed_total", "bad"): 2 * BAD_EVENTS,
        ("wm_retried_total", "bad"): BAD_EVENTS,
        ("wm_dead_lettered_total", "bad"): BAD_EVENTS,
        ("wm_succeeded_total", "bad"): 0,
        ("wm_publish_to_output_seconds_count", "bad"): 0,
    }
    workers = {"good": good, "bad": bad}
    found = {(name, who): _of(samples, name, workers[who]) for name, who in expected}
    assert found == expected
    assert _of(samples, "wm_engine_seconds_sum", good) > 0
    assert samples[("wm_node_consumers", ())] >= 2
    recovery = {labels[0][1]: v for (n, labels), v in samples.items() if n == "wm_node_recovery"}
    assert sum(recovery.values()) == 1 and (recovery["done"] or recovery["elsewhere"])
    assert samples[("wm_node_engines", ())] >= 2  # both workers' engines, in either process
    # the cluster's workers, by status and by health (both have had deliveries judged or not)
    assert samples[("wm_workers", (("status", "running"),))] == 2
    assert samples[("wm_workers", (("status", "stopped"),))] == 0
    health = {labels[0][1]: v for (n, labels), v in samples.items() if n == "wm_workers_health"}
    assert set(health) == {"healthy", "degraded", "unhealthy", "unknown"}
    assert sum(health.values()) == 2


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a node's pool)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_a_pool_process_killed_outright_drops_out_of_the_node_gauges(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    port = free_port()
    settings = pg_settings.replace(health_port=port)
    samples_dir = tmp_path / "prometheus"
    samples_dir.mkdir()
    stale = samples_dir / "counter_1.db"  # a previous node's
    stale.write_bytes(b"")
    env = env_of(settings, PROMETHEUS_MULTIPROC_DIR=str(samples_dir))
    # a command that loads the app without running a node leaves a running node's files be
    loaded = subprocess.run(
        [sys.executable, "-c", "import wm.celeryapp"], env=env, capture_output=True, timeout=60
    )
    assert loaded.returncode == 0, loaded.stderr
    assert stale.exists()

    manager = WorkManager(settings)
    sink = manager.subscribe("reaped.out", "sink")
    worker = manager.create_worker(
        code=stub(output_type="reaped.out"), mime_type=STUB, topic="reaped.in", name="reaped"
    )
    node = start_node(
        settings, name="reaped", concurrency=1, PROMETHEUS_MULTIPROC_DIR=str(samples_dir)
    )
    assert not stale.exists()  # emptied at start
    node.consuming(f"reaped.in::{worker.id}")
    manager.publish(make_event("reaped.in", "/tests", {"n": 1}))
    assert len(drain(settings, sink, 1, timeout_s=30)) == 1
    url = f"http://127.0.0.1:{port}/metrics"
    eventually(lambda: scrape(url)[("wm_node_engines", ())] == 1)

    (child,) = _children(node.proc.pid)
    os.kill(child, signal.SIGKILL)  # no worker_process_shutdown: the scrape must notice
    samples = eventually(lambda: (s := scrape(url))[("wm_node_engines", ())] == 0 and s)
    assert samples[("wm_node_sandbox_processes", ())] == 0
    assert _of(samples, "wm_delivered_total", worker) == 1  # its count stays counted


def test_the_grafana_dashboard_uses_only_metrics_a_node_exposes() -> None:
    dashboard = json.loads((ROOT / "ops" / "grafana" / "workmanager.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"])
    used = {name for expr in exprs for name in re.findall(r"\bwm_[a-z_]+", expr)}
    exposed = {f"wm_{metrics.NAMES.get(kind, kind)}_total" for kind in metrics.COUNTERS}
    exposed |= {f"wm_{name}_bucket" for name, _ in metrics.HISTOGRAMS.values()}
    exposed |= {f"wm_{name}" for name, _ in metrics.GAUGES.values()}
    exposed |= {"wm_node_consumers", "wm_node_recovery", "wm_workers", "wm_workers_health"}
    exposed |= {"wm_queue_depth", "wm_worker_transitions_total", "wm_worker_state_seconds_bucket"}
    assert used and used <= exposed, used - exposed
    counters = {f"wm_{metrics.NAMES.get(kind, kind)}_total" for kind in metrics.COUNTERS}
    assert counters <= used  # every counter has a panel
    assert {"wm_queue_depth", "wm_probe_seconds_bucket", "wm_worker_state_seconds_bucket"} <= used


def test_the_keda_example_is_a_scaled_object_on_the_queue_depth() -> None:
    text = (ROOT / "deploy" / "kubernetes" / "node-scaledobject.yaml").read_text()
    assert f"```yaml\n{text}```" in doc("docs/guides/health.md")  # the docs show it
    scaled = yaml.safe_load(text)
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "wm_queue_depth" in trigger["metadata"]["query"]
    assert float(trigger["metadata"]["threshold"]) > 0  # KEDA wants a string of a number


QUEUED, BAD = 5, 4


def _transitions(manager: WorkManager, workers: list[Any]) -> tuple[dict[Any, float], ...]:
    """What ``/metrics`` must show of the audit trail: moves by edge; per state left, how
    many timed moves and their seconds."""
    moves: dict[Any, float] = {}
    counts: dict[Any, float] = {}
    sums: dict[Any, float] = {}
    for worker in workers:
        for t in manager.get_worker_transitions(worker.id):
            edge = (("from_state", t.from_status or ""), ("to_state", t.to_status))
            moves[edge] = moves.get(edge, 0) + 1
            if t.from_status and t.duration_ms is not None:
                state = (("state", t.from_status),)
                counts[state] = counts.get(state, 0) + 1
                sums[state] = sums.get(state, 0) + t.duration_ms / 1000
    return moves, counts, sums


def _scraped_transitions(samples: dict[Any, float]) -> tuple[dict[Any, float], ...]:
    def named(name: str) -> dict[Any, float]:
        return {labels: v for (n, labels), v in samples.items() if n == name}

    return (
        named("wm_worker_transitions_total"),
        named("wm_worker_state_seconds_count"),
        named("wm_worker_state_seconds_sum"),
    )


@pytest.mark.slow
def test_queue_depth_transitions_and_replacements_after_real_actions(
    pg_settings: Settings, start_node: Any
) -> None:
    port = free_port()
    settings = pg_settings.replace(health_port=port)
    manager = WorkManager(settings)
    sink = manager.subscribe("depth.out", "sink")
    queued = manager.create_worker(
        code=stub(output_type="depth.out"),
        mime_type=STUB,
        topic="depth.in",
        name="queued",
        start=False,
    )
    replaced = manager.create_worker(
        code=stub(fail="bad input", fail_if_data_has="bad"),
        mime_type=STUB,
        topic="replaced.in",
        name="replaced",
        settings={"failure_threshold": 2, "max_retries": 0, "recovery": "replace"},
    )
    node = start_node(settings, name="depth")
    node.consuming(f"replaced.in::{replaced.id}")
    url = f"http://127.0.0.1:{port}/metrics"
    time.sleep(clustermetrics.SETTLE_S)
    first = scrape(url)  # the whole trail so far, in one read
    assert _scraped_transitions(first) == _transitions(manager, [queued, replaced])

    for n in range(QUEUED):  # nobody consumes a stopped worker's queue: they wait
        manager.publish(make_event("depth.in", "/tests", {"n": n}))
    eventually(lambda: _of(scrape(url), "wm_queue_depth", queued) == QUEUED, timeout_s=20)
    assert _of(scrape(url), "wm_queue_depth", replaced) == 0

    time.sleep(0.3)  # time in "created" to measure
    manager.start_worker(queued.id)
    assert len(drain(settings, sink, QUEUED)) == QUEUED
    eventually(lambda: _of(scrape(url), "wm_queue_depth", queued) == 0, timeout_s=20)
    manager.stop_worker(replaced.id)
    manager.start_worker(replaced.id)
    # only the rows added since, added to the first read, once they had time to commit
    moves, counts, sums = _transitions(manager, [queued, replaced])
    scraped = eventually(
        lambda: (got := _scraped_transitions(scrape(url)))[:2] == (moves, counts) and got,
        timeout_s=20,
    )
    assert scraped[2].keys() == sums.keys()
    assert all(abs(scraped[2][k] - sums[k]) < 1e-6 for k in sums)
    assert scraped[2][(("state", "created"),)] >= 0.3
    start = (("from_state", "stopped"), ("to_state", "starting"))
    assert moves[start] == 1  # the replaced worker's restart

    node.consuming(f"replaced.in::{replaced.id}")
    for n in range(BAD):  # one run of failures: one replacement, however long it goes on
        manager.publish(make_event("replaced.in", "/tests", {"n": n, "bad": True}))
    eventually(lambda: _of(scrape(url), "wm_replacements_total", replaced) >= 1, timeout_s=30)
    node.wait_for(f"unloaded worker {replaced.id}")
    eventually(lambda: _of(scrape(url), "wm_failed_total", replaced) == BAD, timeout_s=30)
    time.sleep(1.0)  # a second replacement would show now
    samples = scrape(url)
    assert _of(samples, "wm_replacements_total", replaced) == 1
    assert _of(samples, "wm_failed_total", replaced) == BAD
    assert _of(samples, "wm_replacements_total", queued) == 0
