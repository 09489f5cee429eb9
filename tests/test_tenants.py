"""Tenants (docs/guides/tenants.md): the name rules and explicit creation, names unique per tenant,
another tenant's rows answering exactly like missing ones, and routing isolation through a
real Celery node: two tenants' topics of the same name never meet."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import env_of
from tests.helpers import STUB, drain, eventually, publish_numbered, queue_empty, stub, wm_cli
from wm import (
    ConfigurationError,
    DeadLetterNotFound,
    InvalidArgument,
    ScheduleNotFound,
    Settings,
    SubscriptionNotFound,
    TenantNotFound,
    WorkerNotFound,
    WorkManager,
    make_event,
)

#: Each bad name with what its error says.
BAD_NAMES = [
    ("Acme", "lowercase letters"),
    ("-acme", "starting with a letter or digit"),
    ("ac::me", "lowercase letters"),
    ("ac me", "lowercase letters"),
    ("a" * 64, "the limit is 63"),
    ("", "non-empty"),
]


def _tenants(settings: Settings, *names: str) -> dict[str, WorkManager]:
    for name in names:
        WorkManager(settings).create_tenant(name)
    return {name: WorkManager(settings, tenant=name) for name in (*names, "default")}


def test_tenants_are_created_explicitly_and_their_names_checked(settings: Settings) -> None:
    manager = WorkManager(settings)
    assert manager.tenant == "default"
    assert [(t.name, t.workers) for t in manager.list_tenants()] == [("default", 0)]
    for bad, says in BAD_NAMES:
        with pytest.raises(InvalidArgument, match=says):
            manager.create_tenant(bad)
        with pytest.raises(InvalidArgument, match=says):
            WorkManager(settings, tenant=bad)
    with pytest.raises(TenantNotFound, match=r"no tenant 'acme'.*wm tenant create acme"):
        WorkManager(settings, tenant="acme")
    assert manager.create_tenant("acme").name == "acme"
    for taken in ("acme", "default"):
        with pytest.raises(InvalidArgument, match=f"tenant '{taken}' exists already"):
            manager.create_tenant(taken)
    assert WorkManager(settings, tenant="acme").tenant == "acme"
    assert WorkManager(settings.replace(tenant="acme")).tenant == "acme"  # WM_TENANT
    with pytest.raises(ConfigurationError, match="WM_TENANT"):
        Settings.from_env({"WM_TENANT": "Acme"})
    assert [t.name for t in manager.list_tenants()] == ["acme", "default"]


def test_names_are_per_tenant_and_another_tenants_rows_are_not_found(
    settings: Settings,
) -> None:
    by = _tenants(settings, "acme", "beta")
    acme, beta = by["acme"], by["beta"]
    made = {
        t: m.create_worker(code=stub(), mime_type=STUB, topic="in", name="orders", start=False)
        for t, m in by.items()
    }
    assert {t: (w.tenant, w.topic, w.name) for t, w in made.items()} == {
        t: (t, "in", "orders") for t in by
    }
    with pytest.raises(InvalidArgument, match="already named 'orders'"):
        acme.create_worker(code=stub(), mime_type=STUB, topic="x", name="orders", start=False)
    for tenant, manager in by.items():
        assert manager.get_worker("orders").id == made[tenant].id
        assert [w.id for w in manager.list_workers(topic="in")] == [made[tenant].id]
    assert [(t.name, t.workers) for t in acme.list_tenants()] == [
        ("acme", 1),
        ("beta", 1),
        ("default", 1),
    ]
    _foreign_workers_answer_like_missing_ones(acme, made["beta"].id)
    _foreign_schedules_are_not_found(acme, beta, made["beta"].id)
    queues = {t: m.subscribe("out", "sink") for t, m in by.items()}
    assert queues == {
        "acme": "acme::out::sub::sink",
        "beta": "beta::out::sub::sink",
        "default": "out::sub::sink",
    }
    listed = acme.list_subscriptions()
    assert [(s["topic"], s["queue"]) for s in listed] == [
        ("in", f"acme::in::{made['acme'].id}"),
        ("out", "acme::out::sub::sink"),
    ]
    for foreign in (queues["beta"], queues["default"], "acme::never::sub::made"):
        with pytest.raises(SubscriptionNotFound, match="no subscription has the queue"):
            next(acme.receive(foreign, idle_s=0.1))
    assert list(beta.receive(queues["beta"], idle_s=0.1)) == []
    acme.unsubscribe("out", "sink")
    assert [s["queue"] for s in beta.list_subscriptions("out")] == ["beta::out::sub::sink"]
    assert [r.queue for r in beta.bus.routes("beta::in")] == [f"beta::in::{made['beta'].id}"]
    with pytest.raises(InvalidArgument, match="255 bytes"):
        acme.subscribe("t" * 120 + "-dead", "s" * 120)  # 258 bytes with "acme::"


def _error(call: Callable[[], Any]) -> tuple[type[Exception], str]:
    with pytest.raises(WorkerNotFound) as caught:
        call()
    return type(caught.value), str(caught.value)


def _foreign_workers_answer_like_missing_ones(mine: WorkManager, foreign: uuid.UUID) -> None:
    """Every way of naming ``foreign`` from ``mine`` fails exactly as for a worker no one
    has (the id itself aside, which the caller gave)."""
    missing = uuid.uuid4()
    calls: list[Callable[[uuid.UUID | str], Any]] = [
        mine.get_worker,
        mine.start_worker,
        mine.stop_worker,
        mine.delete_worker,
        mine.get_worker_history,
        mine.get_worker_transitions,
        mine.worker_details,
        lambda ref: mine.add_schedule(ref, event_type="tick", every_s=60),
        lambda ref: mine.load_code_from_content(ref, stub(outputs=2)),
    ]
    for call in calls:
        for as_given in (str, lambda wid: wid):
            got = _error(lambda c=call, g=as_given: c(g(foreign)))
            expected = _error(lambda c=call, g=as_given: c(g(missing)))
            assert (got[0], got[1].replace(str(foreign), "ID")) == (
                expected[0],
                expected[1].replace(str(missing), "ID"),
            )
    short = str(foreign)[:8]
    assert _error(lambda: mine.get_worker(short))[1] == (
        f"no worker with id, short id or name {short!r}"
    )
    with pytest.raises(WorkerNotFound):
        mine.worker_id_of(str(foreign)[:8])


def _foreign_schedules_are_not_found(
    mine: WorkManager, theirs: WorkManager, worker: uuid.UUID
) -> None:
    schedule = theirs.add_schedule(worker, event_type="tick", every_s=60)
    assert mine.list_schedules() == []
    for ref in (schedule.id, schedule.id[:8]):
        with pytest.raises(ScheduleNotFound, match="no schedule with id or short id"):
            mine.remove_schedule(ref)
    assert [s.id for s in theirs.list_schedules()] == [schedule.id]


@pytest.mark.slow
def test_two_tenants_topics_of_one_name_never_meet(pg_settings: Settings, start_node: Any) -> None:
    """Three tenants (two named, and the default), each with a worker ``orders`` on ``in``
    that outputs to ``out``, every setting at its default: an event published to ``in`` in
    one tenant runs that tenant's worker alone, its output reaches that tenant's ``out``
    only, and a dead letter stays in its tenant."""
    settings = pg_settings
    by = _tenants(settings, "acme", "beta")
    node = start_node(settings)
    outs = {t: m.subscribe("out", "sink") for t, m in by.items()}
    deads = {t: m.subscribe("in-dead", "alerts") for t, m in by.items()}
    code = stub(output_type="out", fail="boom", fail_if_data_has="poison")
    made = {
        t: m.create_worker(
            code=code,
            mime_type=STUB,
            topic="in",
            name="orders",
            settings={"max_retries": 0},
        )
        for t, m in by.items()
    }
    for tenant, worker in made.items():
        node.consuming(("in" if tenant == "default" else f"{tenant}::in") + f"::{worker.id}")
    acme = by["acme"]

    publish_numbered(acme, "in", 1)
    [out] = drain(settings, outs["acme"], 1)
    assert out["source"] == f"/workers/{made['acme'].id}"
    assert out["wmtenant"] == "acme"
    assert (out["data"]["tenant"], out["data"]["event_tenant"]) == ("acme", "acme")
    assert queue_empty(settings, outs["beta"], 1.0) and queue_empty(settings, outs["default"])

    acme.publish(make_event("in", "/tests", {"poison": 1}))
    [alert] = drain(settings, deads["acme"], 1)
    assert (alert["wmtenant"], alert["data"]["topic"]) == ("acme", "in")
    [letter] = acme.dead_letters.list()
    assert (letter.topic, letter.worker_id) == ("in", str(made["acme"].id))
    for other in ("beta", "default"):
        assert by[other].dead_letters.list() == [] and by[other].dead_letters.count() == 0
        for ref in (letter.id, letter.id[:8]):
            with pytest.raises(DeadLetterNotFound, match="no dead letter with id or short id"):
                by[other].dead_letters.get(ref)
        with pytest.raises(DeadLetterNotFound):
            by[other].dead_letters.replay([letter.id])
        assert queue_empty(settings, deads[other])

    publish_numbered(by["default"], "in", 1)  # the default tenant: as before tenants
    [plain] = drain(settings, outs["default"], 1)
    assert plain["source"] == f"/workers/{made['default'].id}"
    assert "wmtenant" not in plain and "tenant" not in plain["data"]
    assert queue_empty(settings, outs["acme"]) and queue_empty(settings, outs["beta"])

    # Worker code names bare topics: another tenant's is out of its reach.
    escape = acme.create_worker(
        code=stub(output_type="beta::out"),
        mime_type=STUB,
        topic="escape",
        settings={"max_retries": 0},
    )
    node.consuming(f"acme::escape::{escape.id}")
    acme.publish(make_event("escape", "/tests", {}))
    [refused] = eventually(lambda: acme.dead_letters.list(worker_id=str(escape.id)))
    assert refused.error_type == "OutputRefused" and "'::'" in refused.error_message
    assert queue_empty(settings, outs["beta"])


def test_the_command_line_works_in_the_tenant_it_is_given(pg_settings: Settings) -> None:
    settings = pg_settings
    assert wm_cli(settings, "tenant", "create", "acme")["name"] == "acme"
    created = wm_cli(
        settings,
        "--tenant",
        "acme",
        "worker",
        "create",
        "--topic",
        "in",
        "--name",
        "orders",
        "--mime-type",
        STUB,
        "--file",
        "-",
        "--no-start",
        stdin=stub().decode(),
    )
    assert (created["tenant"], created["topic"]) == ("acme", "in")
    listed = wm_cli(settings.replace(tenant="acme"), "worker", "list")  # WM_TENANT
    assert [w["id"] for w in listed] == [created["id"]]
    assert wm_cli(settings, "worker", "list") == []
    shown = wm_cli(settings, "worker", "show", "orders", "--tenant", "acme")
    assert (shown["id"], shown["tenant"]) == (created["id"], "acme")
    table = _wm(settings, "--tenant", "acme", "worker", "list")
    assert table.returncode == 0 and table.stdout.split()[:2] == ["TENANT", "ID"]
    for args, says in [
        (("--tenant", "beta", "worker", "list"), "no tenant 'beta'"),
        (("worker", "show", "orders"), "no worker with id, short id or name 'orders'"),
        (("tenant", "create", "Acme"), "tenant 'Acme' is not a valid tenant name"),
    ]:
        failed = _wm(settings, *args)
        assert (failed.returncode, failed.stdout) == (1, "")
        assert failed.stderr.startswith("wm: error: ") and says in failed.stderr, failed.stderr
    assert [t["name"] for t in wm_cli(settings, "tenant", "list")] == ["acme", "default"]


def _wm(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wm.cli", *args],
        env=env_of(settings, COLUMNS="200"),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_tenant_reads_its_own_lifecycle_events(pg_settings: Settings) -> None:
    """``workmanager.lifecycle`` in a tenant carries that tenant's workers' events alone; the
    deployment's (the default tenant's) carries every tenant's, with a ``tenant`` field."""
    managers = _tenants(pg_settings, "acme", "beta")
    inbox = {t: m.subscribe("workmanager.lifecycle", "watch") for t, m in managers.items()}
    made = {
        t: managers[t].create_worker(code=stub(), mime_type=STUB, topic="in", start=False)
        for t in ("acme", "beta")
    }
    for tenant in ("acme", "beta"):
        [event] = drain(pg_settings, inbox[tenant], 1, timeout_s=10)
        assert event["type"].endswith(".created") and event["subject"] == str(made[tenant].id)
        assert event["data"]["tenant"] == tenant and event["data"]["topic"] == "in"
        assert drain(pg_settings, inbox[tenant], 1, timeout_s=1) == []  # not the other's
    everyone = drain(pg_settings, inbox["default"], 2, timeout_s=10)
    assert {e["data"]["tenant"] for e in everyone} == {"acme", "beta"}
