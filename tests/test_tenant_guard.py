"""The tenant guard and the tenant everywhere (docs/guides/tenants.md "What is isolated and what is
shared"): a message forged into another tenant's queue is refused before any store is
touched, worker code cannot publish into another tenant, lookups stay in the caller's
tenant, and metrics, log lines, spans, events and task names carry the tenant. Real nodes,
every setting at its default but the health port, the log format and the exporter."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from kombu import Connection

from tests.helpers import STUB, drain, eventually, free_port, queue_empty, scrape, stub
from wm import Settings, WorkManager, make_event
from wm.dataplane.queues import DELIVER_TASK, queue_tenant, subscription_queue
from wm.events import GROUPLOCK_TOPIC, LIFECYCLE_TOPIC, encode, key_of
from wm.state.ledger import Ledger
from wm.state.outcomes import Outcomes


def _tenants(settings: Settings, *names: str) -> dict[str, WorkManager]:
    for name in names:
        WorkManager(settings).create_tenant(name)
    return {name: WorkManager(settings, tenant=name) for name in (*names, "default")}


def test_a_worker_queue_names_its_tenant() -> None:
    wid = "4b0c6c52-2f5e-4d8e-9a55-3f7b1c9e2d10"
    assert queue_tenant(f"acme::in::{wid}") == "acme"
    assert queue_tenant(f"in::{wid}") == "default"
    for not_a_worker_queue in ("acme::in::sub::sink", "in::sub::sink", "wm.default", "unknown"):
        assert queue_tenant(not_a_worker_queue) is None


def test_worker_names_are_looked_up_in_the_callers_tenant(settings: Settings) -> None:
    by = _tenants(settings, "acme", "beta")
    theirs = by["beta"].create_worker(code=stub(), mime_type=STUB, topic="in", name="orders")
    assert by["beta"].worker_names([theirs.id]) == {str(theirs.id): "orders"}
    for other in ("acme", "default"):  # as for an id no one has
        assert by[other].worker_names([theirs.id]) == {}
    assert by["acme"].worker_names([theirs.id], all_tenants=True) == {str(theirs.id): "orders"}


def _forge(manager: WorkManager, queue: str, worker_id: str, **extensions: Any) -> str:
    """Send a ``wm.deliver`` message straight into ``queue``, as something other than
    WorkManager's publish would (no routing, no pending ledger); its event's id."""
    event = make_event("in", "/forger", {"forged": True}, extensions=extensions or None)
    manager.bus.app.send_task(DELIVER_TASK, args=[worker_id, encode(event)], queue=queue)
    return event.get_id()


#: Beta's own events in the batched worker's queue, and after which of them one is forged:
#: far enough behind the head that the node's prefetch (4 messages) leaves them to a batch.
BULK, FORGED_AFTER = 20, (12, 16)


def _refusals(samples: dict[Any, float], tenant: str) -> float:
    return samples.get(("wm_tenant_refusals_total", (("tenant", tenant),)), 0.0)


@pytest.mark.slow
def test_a_forged_message_is_refused_and_touches_nothing_of_the_tenant(
    pg_settings: Settings, start_node: Any
) -> None:
    """Into beta's queue: an event of acme, and one of the default tenant (no extension);
    into acme's queue, naming beta's worker: an event of acme; among beta's own events in a
    batched worker's queue: two events of acme, which its batches take as followers (they
    wait behind what the node prefetches). All wait before the node starts. Each forged one
    is dropped with a line naming both tenants and counted; beta's workers never run them
    (no output, no outcome, no pending entry, no dead letter anywhere), and beta's own
    events run as ever."""
    port = free_port()
    settings = pg_settings.replace(health_port=port)
    by = _tenants(settings, "acme", "beta")
    acme, beta = by["acme"], by["beta"]
    outs = {t: m.subscribe("out", "sink") for t, m in by.items()}
    made = {
        t: by[t].create_worker(code=stub(output_type="out"), mime_type=STUB, topic="in", name="w")
        for t in ("acme", "beta")
    }
    bulk = beta.create_worker(
        code=stub(output_type="out"), mime_type=STUB, topic="bulk", settings={"batch_size": 30}
    )
    queues = {t: f"{t}::in::{made[t].id}" for t in made}
    queues["bulk"] = f"beta::bulk::{bulk.id}"
    theirs, batched = str(made["beta"].id), str(bulk.id)

    forged = [
        _forge(acme, queues["beta"], theirs, wmtenant="acme"),
        _forge(acme, queues["beta"], theirs),
        _forge(acme, queues["acme"], theirs, wmtenant="acme"),
    ]
    forged_bulk = []
    for n in range(1, BULK + 1):
        beta.publish(make_event("bulk", "/tests", {"n": n}))
        if n in FORGED_AFTER:
            forged_bulk.append(_forge(acme, queues["bulk"], batched, wmtenant="acme"))
    node = start_node(settings, name="guard", concurrency=1, WM_LOG_FORMAT="json")
    for queue in queues.values():
        node.consuming(queue)
    url = f"http://127.0.0.1:{port}/metrics"
    eventually(lambda: _refusals(scrape(url), "beta") == 5, timeout_s=30)
    beta.publish(make_event("in", "/tests", {"n": 0}))  # beta's own event, after them
    outputs = drain(settings, outs["beta"], BULK + 1)
    assert sorted(o["data"]["input"]["n"] for o in outputs) == list(range(BULK + 1))
    for tenant in by:
        assert queue_empty(settings, outs[tenant], 0.5)
        assert by[tenant].dead_letters.count() == 0
    outcomes, ledger = Outcomes(settings), Ledger(settings)
    for worker_id, ids in ((theirs, forged), (batched, forged_bulk)):
        for event_id in ids:
            event = make_event("in", "/forger", id=event_id)
            assert outcomes.get(worker_id, key_of(event)) is None
        assert ledger.pending(worker_id) == 0
    samples = scrape(url)
    assert _refusals(samples, "acme") == 0 and _refusals(samples, "default") == 0
    ran = ("wm_delivered_total", (("tenant", "beta"), ("worker", "w"), ("worker_id", theirs)))
    assert samples[ran] == 1  # beta's own event only reached its worker

    lines = _log_records(node.log.read_text(errors="replace"))
    refused = [r for r in lines if r["logger"] == "wm.dataplane.guard"]
    assert len(refused) == 5 and all(r["level"] == "ERROR" for r in refused)
    said = [r["message"] for r in refused]
    into_beta = f"but reached the queue '{queues['beta']}' of tenant 'beta'"
    assert sum(f"in tenant 'acme' {into_beta}" in m for m in said) == 1
    assert sum(f"in tenant 'default' {into_beta}" in m for m in said) == 1
    assert sum(f"reached worker {theirs} of tenant 'beta'" in m for m in said) == 1
    assert sum(f"reached worker {batched} of tenant 'beta'" in m for m in said) == 2
    assert all("forged or misrouted" in m for m in said)


def _log_records(text: str) -> list[dict[str, Any]]:
    """The node's JSON log lines (its banner and other lines skipped)."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "logger" in record:
            records.append(record)
    return records


ESCAPES = """
from wm.devkit import make_event


def process(event):
    return make_event("out", "/escape", {"n": 1}, extensions={"wmtenant": "beta"})
"""

QUALIFIED = """
from wm.devkit import make_event


def process(event):
    return make_event("beta::out", "/escape", {"n": 1})
"""


@pytest.mark.slow
def test_worker_code_cannot_publish_into_another_tenant(
    pg_settings: Settings, start_node: Any
) -> None:
    """A Python worker of acme that sets ``wmtenant: beta`` on its output: the output stays
    in acme (stamped acme); one that names ``beta::out``: refused as OutputRefused, parked
    in acme. Beta's subscriber of ``out`` never hears of either."""
    settings = pg_settings
    by = _tenants(settings, "acme", "beta")
    acme = by["acme"]
    outs = {t: m.subscribe("out", "sink") for t, m in by.items()}
    python = {"mime_type": "text/x-python", "settings": {"max_retries": 0}}
    stamped = acme.create_worker(code=ESCAPES, topic="in", **python)
    named = acme.create_worker(code=QUALIFIED, topic="named", **python)
    node = start_node(settings, name="escape")
    node.consuming(f"acme::in::{stamped.id}")
    node.consuming(f"acme::named::{named.id}")

    acme.publish(make_event("in", "/tests", {}))
    acme.publish(make_event("named", "/tests", {}))
    [out] = drain(settings, outs["acme"], 1)
    assert (out["wmtenant"], out["source"]) == ("acme", "/escape")
    [letter] = eventually(lambda: acme.dead_letters.list(worker_id=str(named.id)))
    assert letter.error_type == "OutputRefused"
    assert "'beta::out'" in letter.error_message and "'::'" in letter.error_message
    assert queue_empty(settings, outs["beta"], 1.0) and queue_empty(settings, outs["default"])
    assert by["beta"].dead_letters.count() == 0


def _task_name(settings: Settings, queue: str) -> str:
    """The Flower name (``shadow``) of the first message waiting in a worker queue."""
    with Connection(settings.broker_url) as conn:
        simple = conn.SimpleQueue(subscription_queue(queue))
        try:
            message = simple.get(timeout=10)
            message.ack()
            return str(message.headers["shadow"])
        finally:
            simple.close()


@pytest.mark.slow
def test_metrics_logs_spans_events_and_task_names_carry_the_tenant(
    pg_settings: Settings, start_node: Any
) -> None:
    port = free_port()
    settings = pg_settings.replace(health_port=port, infra_events=True)
    by = _tenants(settings, "acme")
    acme, default = by["acme"], by["default"]
    sink = acme.subscribe("out", "sink")
    lifecycle = default.subscribe(LIFECYCLE_TOPIC, "watch")
    locks = default.subscribe(GROUPLOCK_TOPIC, "locks")
    code = stub(output_type="out", fail="boom", fail_if_data_has="poison")
    worker = acme.create_worker(
        code=code,
        mime_type=STUB,
        topic="in",
        name="shout",
        group="g",
        settings={"max_retries": 0},
    )
    idle = acme.create_worker(code=stub(), mime_type=STUB, topic="idle", name="idle", start=False)
    acme.publish(make_event("idle", "/tests", {}))
    assert _task_name(settings, f"acme::idle::{idle.id}") == "deliver acme::idle → idle"

    node = start_node(settings, name="told", WM_LOG_FORMAT="json", OTEL_TRACES_EXPORTER="console")
    node.consuming(f"acme::in::{worker.id}")
    event = make_event("in", "/tests", {"n": 1})
    acme.publish(event)
    acme.publish(make_event("in", "/tests", {"poison": 1}))
    assert len(drain(settings, sink, 1)) == 1
    eventually(lambda: acme.dead_letters.count() == 1)

    url = f"http://127.0.0.1:{port}/metrics"
    labels = (("tenant", "acme"), ("worker", "shout"), ("worker_id", str(worker.id)))
    # the node counts a dead letter once it is stored: the row may be read before the count
    counted = ("wm_succeeded_total", labels), ("wm_dead_lettered_total", labels)
    samples = eventually(lambda: (s := scrape(url)) and all(s.get(k) for k in counted) and s)
    assert samples[("wm_dead_lettered_total", labels)] == 1
    assert samples[("wm_engine_seconds_count", labels)] == 2
    depth = (("tenant", "acme"), ("worker", "idle"), ("worker_id", str(idle.id)))
    assert ("wm_queue_depth", depth) in samples

    text = node.log.read_text(errors="replace")
    about = [r for r in _log_records(text) if r.get("event_id") == event.get_id()]
    assert about and all(r["tenant"] == "acme" and r["topic"] == "acme::in" for r in about)
    delivered = eventually(
        lambda: [
            s
            for s in _spans(node.log.read_text(errors="replace"))
            if s["name"] == "deliver in"
            and s["attributes"]["cloudevents.event_id"] == event.get_id()
        ]
    )
    assert delivered[0]["attributes"]["workmanager.tenant"] == "acme"

    [lock, *_] = drain(settings, locks, 1)
    assert (lock["subject"], lock["data"]["group"], lock["data"]["tenant"]) == (
        "acme::g",
        "g",
        "acme",
    )
    told = drain(settings, lifecycle, 20, timeout_s=5)
    [error] = [e for e in told if e["type"].endswith(".error")]
    assert (error["data"]["tenant"], error["data"]["topic"]) == ("acme", "in")
    assert all(e["data"].get("tenant") == "acme" for e in told), told


def _spans(text: str) -> list[dict[str, Any]]:
    """The spans the console exporter printed (one JSON block each)."""
    return [json.loads(b) for b in re.findall(r"^\{\n.*?^\}$", text, flags=re.M | re.S)]
