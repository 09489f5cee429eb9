"""The ``wm`` command as an operator runs it: a real process against real Redis, SQLite and
PostgreSQL, with events read back from the broker by an ordinary kombu client."""

from __future__ import annotations

import base64
import json
import logging
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.cli_env import GUARD_S, ROOT, one_error_line, wm, wm_json
from tests.helpers import STUB, drain, stub
from wm import Settings, WorkManager, store
from wm.cli import EXIT_CODES, HOST_PROBES, main
from wm.config import settings_table
from wm.dataplane.deadletters import DeadLetters, Failure
from wm.errors import Misconfigured
from wm.events import encode, key_of, make_event

LIFECYCLE = "workmanager.lifecycle"
LIFECYCLE_TYPE = "com.virtufin.workmanager.lifecycle."


def create(env: dict[str, str], tmp_path: Path, *extra: str, topic: str = "orders") -> Any:
    path = tmp_path / f"code-{uuid.uuid4().hex[:6]}.json"
    path.write_bytes(stub(output_type="done"))
    return wm_json(
        env, "worker", "create", "--topic", topic, "--mime-type", STUB, "--file", str(path), *extra
    )


def drain_env(env: dict[str, str], queue: str, count: int) -> list[dict[str, Any]]:
    """Read ``count`` events from a plain-subscription queue with an ordinary kombu client."""
    return drain(Settings.from_env(env), queue, count, timeout_s=GUARD_S)


def tail_queues(env: dict[str, str], topic: str) -> list[str]:
    found = wm_json(env, "subscriptions", "--topic", topic)
    return [s["queue"] for s in found if "::sub::tail-" in s["queue"]]


def start_tail(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    """Start ``wm tail`` and return once its temporary subscription exists."""
    tail = subprocess.Popen(
        [sys.executable, "-m", "wm.cli", "tail", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + GUARD_S
    while not tail_queues(env, args[0]):
        if tail.poll() is not None or time.monotonic() > deadline:
            tail.kill()
            raise AssertionError(f"wm tail never subscribed:\n{tail.communicate()[1].decode()}")
        time.sleep(0.2)
    return tail


def finish(tail: subprocess.Popen[bytes]) -> tuple[str, str]:
    try:
        out, err = tail.communicate(timeout=GUARD_S)
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait()
    assert tail.returncode == 0, err.decode()
    return out.decode(), err.decode()


# -- workers -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_create_from_file_then_list_and_show(env: dict[str, str], tmp_path: Path) -> None:
    made = create(
        env,
        tmp_path,
        "--name",
        "billing",
        "--group",
        "g1",
        "--setting",
        "timeout_s=2.5",
        "--setting",
        "max_retries=3",
    )
    assert made["status"] == "running"
    assert made["settings"] == {"timeout_s": 2.5, "max_retries": 3}

    listed = wm(env, "worker", "list").out.splitlines()
    assert listed[0].split() == [
        "ID",
        "NAME",
        "TOPIC",
        "GROUP",
        "STATUS",
        "HEALTH",
        "VERSION",
        "MIME",
        "TYPE",
    ]
    assert listed[1].split() == [
        made["id"],
        "billing",
        "orders",
        "g1",
        "running",
        "unknown",
        "1",
        STUB,
    ]
    assert wm_json(env, "worker", "list", "--topic", "orders") == [made]
    assert wm_json(env, "worker", "list", "--status", "stopped") == []
    shown_json = wm_json(env, "worker", "show", "billing")  # the worker, then what show adds
    assert {key: shown_json[key] for key in made} == made
    assert (shown_json["queue_depth"], shown_json["dead_letters"]) == (0, 0)
    shown = " ".join(wm(env, "worker", "show", made["id"]).out.split())
    assert f"sha256: {made['sha256']}" in shown


@pytest.mark.slow
def test_create_from_stdin_and_from_base64(env: dict[str, str]) -> None:
    from_stdin = stub(output_type="from.stdin")
    made = wm_json(
        env,
        "worker",
        "create",
        "--topic",
        "a",
        "--mime-type",
        STUB,
        "--file",
        "-",
        stdin=from_stdin,
    )
    assert wm(env, "worker", "code", made["id"]).raw == from_stdin

    inline = stub(output_type="from.base64")
    encoded = base64.b64encode(inline).decode()
    made = wm_json(
        env,
        "worker",
        "create",
        "--topic",
        "b",
        "--mime-type",
        STUB,
        "--base64",
        encoded,
        "--no-start",
    )
    assert made["status"] == "created"
    assert wm_json(env, "worker", "code", made["id"])["code_base64"] == encoded


@pytest.mark.slow
def test_json_is_a_global_flag_before_or_after_the_command(
    env: dict[str, str], tmp_path: Path
) -> None:
    create(env, tmp_path, "--name", "either")
    before = json.loads(wm(env, "--json", "worker", "show", "either").out)
    after = json.loads(wm(env, "worker", "show", "either", "--json").out)
    for shown in (before, after):  # their windows start at a clock minute, which may pass
        del shown["deliveries_last_minute"], shown["deliveries_window"]
    assert before == after
    assert before["name"] == "either"


@pytest.mark.slow
def test_history_after_update_code_and_rollback(env: dict[str, str], tmp_path: Path) -> None:
    made = create(env, tmp_path, "--name", "versions")
    second = stub(output_type="second")
    updated = wm_json(
        env,
        "worker",
        "update-code",
        "versions",
        "--base64",
        base64.b64encode(second).decode(),
        "--note",
        "faster",
    )
    assert updated["current_version"] == 2

    history = wm_json(env, "worker", "history", "versions")
    assert [(v["version"], v["note"]) for v in history] == [(1, "created"), (2, "faster")]
    rows = wm(env, "worker", "history", "versions").out.splitlines()
    assert rows[2].split()[:2] == ["2", "*"]

    rolled = wm_json(env, "worker", "rollback", "versions", "1")
    assert rolled["current_version"] == 1
    assert rolled["sha256"] == made["sha256"]
    assert wm(env, "worker", "code", "versions").raw == stub(output_type="done")
    assert wm(env, "worker", "code", "versions", "--version", "2").raw == second
    reasons = [t["reason"] for t in wm_json(env, "worker", "transitions", "versions")]
    assert reasons[-2:] == ["code updated to version 2", "rolled back from version 2 to version 1"]
    error = one_error_line(wm(env, "worker", "rollback", "versions", "9", expect=1))
    assert "no version 9" in error


@pytest.mark.slow
def test_stop_and_start_are_idempotent(env: dict[str, str], tmp_path: Path) -> None:
    made = create(env, tmp_path)
    for _ in range(2):
        assert wm_json(env, "worker", "stop", made["id"])["status"] == "stopped"
    after_stops = len(wm_json(env, "worker", "transitions", made["id"]))
    for _ in range(2):
        assert wm_json(env, "worker", "start", made["id"])["status"] == "running"
    statuses = [t["to_status"] for t in wm_json(env, "worker", "transitions", made["id"])]
    assert len(statuses) == after_stops + 2
    assert statuses[-4:] == ["stopping", "stopped", "starting", "running"]
    assert wm(env, "worker", "stop", made["id"]).out.strip() == (
        f"worker {made['id']}: stopped, version 1"
    )


@pytest.mark.slow
def test_start_after_delete_fails_with_one_error_line(env: dict[str, str], tmp_path: Path) -> None:
    made = create(env, tmp_path, "--name", "doomed")
    assert wm_json(env, "worker", "delete", "doomed")["status"] == "deleted"
    result = wm(env, "worker", "start", made["id"], expect=1)
    assert "deleted" in one_error_line(result)
    assert result.out == ""
    assert "no worker with id, short id or name 'doomed'" in one_error_line(
        wm(env, "worker", "show", "doomed", expect=1)
    )
    assert wm_json(env, "worker", "list") == []


@pytest.mark.slow
def test_a_deleted_worker_s_history_by_its_name_and_short_id(
    env: dict[str, str], tmp_path: Path
) -> None:
    """What the worker did stays readable after its deletion, by the names people use."""
    made = create(env, tmp_path, "--name", "retired")
    wm_json(env, "worker", "delete", "retired")
    for reference in ("retired", made["id"][:8], made["id"]):
        steps = wm_json(env, "worker", "transitions", reference)
        assert steps[-1]["to_status"] == "deleted", reference
        [version] = wm_json(env, "worker", "history", reference)
        assert (version["worker_id"], version["version"]) == (made["id"], 1)
    missing = "no worker with id, short id or name 'nobody'"
    for command in ("transitions", "history"):
        assert missing in one_error_line(wm(env, "worker", command, "nobody", expect=1))


def test_the_engine_is_told_by_the_code_file_s_name(env: dict[str, str], tmp_path: Path) -> None:
    code = tmp_path / "echo.py"
    code.write_text("def process(event):\n    return None\n")
    made = wm_json(env, "worker", "create", "--topic", "t", "--file", str(code), "--no-start")
    assert made["mime_type"] == "text/x-python"
    wm_json(env, "worker", "delete", made["id"])
    plain = tmp_path / "echo.txt"
    plain.write_bytes(code.read_bytes())
    for given in (["--file", str(plain)], ["--base64", "ZGVm"]):
        result = wm(env, "worker", "create", "--topic", "t", *given, expect=2)
        error = result.err.strip().splitlines()[-1]
        assert error.startswith("Error: --mime-type is needed: the engine cannot be told from")
        assert ".py (text/x-python), .cs (text/x-csharp)" in error
    assert wm_json(env, "worker", "list") == []


def test_unknown_mime_type_lists_the_registered_ones(env: dict[str, str]) -> None:
    result = wm(
        env,
        "worker",
        "create",
        "--topic",
        "t",
        "--mime-type",
        "text/x-cobol",
        "--base64",
        "e30=",
        expect=1,
    )
    error = one_error_line(result)
    assert "'text/x-cobol'" in error
    assert (
        "Registered: application/x-dotnet-dll, application/x-native-dll, application/x-wm-stub, "
        "text/x-csharp, text/x-python" in error
    )
    assert wm_json(env, "worker", "list") == []


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (["--base64", base64.b64encode(b'{"nope": 1}').decode()], "unknown key 'nope'"),
        (["--base64", base64.b64encode(b"not json").decode()], "must be a JSON object"),
        (["--base64", "e30"], "not valid base64"),
        (["--file", "/nonexistent/code.json"], "cannot read /nonexistent/code.json"),
        (["--base64", "e30=", "--sha256", "0" * 64], "but the pin is"),
        (["--base64", "e30=", "--setting", "retries=3"], "unknown worker setting 'retries'"),
    ],
)
def test_bad_code_or_settings_are_refused_and_nothing_is_persisted(
    env: dict[str, str], source: list[str], message: str
) -> None:
    result = wm(
        env,
        "worker",
        "create",
        "--topic",
        "t",
        "--mime-type",
        STUB,
        "--name",
        "bad",
        *source,
        expect=1,
    )
    assert message in one_error_line(result)
    stored = WorkManager(Settings.from_env(env))  # read in-process: a `wm` process costs ~0.6 s
    assert stored.list_workers(status="created") == stored.list_workers() == []
    assert stored.list_subscriptions() == []


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("GROUP_LOCK_MAX_RETRIES", "abc", "GROUP_LOCK_MAX_RETRIES='abc' is malformed"),
        ("WM_MAX_RETRIES", "-1", "WM_MAX_RETRIES='-1' is malformed"),
        ("WM_BROKER_URLL", "redis://x", "unknown setting WM_BROKER_URLL. Did you mean"),
        ("WM_LOG_LEVEL", "loud", "WM_LOG_LEVEL='loud' is malformed"),
    ],
)
def test_malformed_environment_names_the_variable(
    env: dict[str, str], variable: str, value: str, message: str
) -> None:
    result = wm({**env, variable: value}, "worker", "list", expect=1)
    assert message in one_error_line(result)


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("WM_DATABASE_URL", "postgresql+psycopg://wm:secret@db:5o32/wm", "the port '5o32' is"),
        ("WM_DATABASE_URL", "postgresql+psycopg://wm@db:70000/wm", "the port '70000' is"),
        ("WM_DATABASE_URL", "db:5432/wm", "not a URL (no scheme://)"),
        ("WM_DATABASE_URL", "postgresql://wm@[::1/wm", "not a URL (Invalid IPv6 URL)"),
        ("WM_BROKER_URL", "http://127.0.0.1:6379/0", "the scheme 'http' is not one"),
        ("WM_BROKER_URL", "redis://:secret@127.0.0.1:port/0", "the port 'port' is"),
        ("WM_BROKER_URL", "127.0.0.1:6379", "not a URL (no scheme://)"),
        ("WM_REDIS_URL", "redis://127.0.0.1:6379x/1", "the port '6379x' is"),
        ("WM_REDIS_URL", "amqp://guest@rabbit//", "the scheme 'amqp' is not one"),
    ],
)
def test_a_malformed_url_is_one_line_naming_the_setting(
    env: dict[str, str], variable: str, value: str, says: str
) -> None:
    """Finding 11: a malformed database port printed a traceback; an http:// broker was
    taken until a node tried it."""
    result = wm({**env, variable: value}, "worker", "list", expect=EXIT_CODES[Misconfigured])
    line = one_error_line(result)
    assert line.startswith(f"wm: error: {variable}=") and says in line, line
    assert "secret" not in line


def test_a_postgresql_url_without_the_extra_says_what_to_install(
    env: dict[str, str], tmp_path: Path
) -> None:
    """psycopg hidden behind a package that cannot be imported, as on a machine installed
    without the [postgres] extra."""
    hidden = tmp_path / "psycopg"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('not installed', name='psycopg')\n")
    path = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    url = "postgresql+psycopg://wm@127.0.0.1:5432/wm"
    result = wm({**env, "PYTHONPATH": path, "WM_DATABASE_URL": url}, "worker", "list", expect=1)
    line = one_error_line(result)
    assert line.startswith(f"wm: error: WM_DATABASE_URL={url} needs the driver module 'psycopg'")
    assert "pip install -e '.[postgres]'" in line, line  # from this checkout


@pytest.mark.parametrize(
    ("node", "says"),
    [
        ("ftp://127.0.0.1:8001/health", "is not an http:// URL"),
        ("http://127.0.0.1:80O1/health", "could not be cast to integer"),
        ("http://[::1/health", "Invalid IPv6 URL"),
    ],
)
def test_a_malformed_health_url_is_one_line(env: dict[str, str], node: str, says: str) -> None:
    line = one_error_line(wm(env, "health", "--node", node, expect=3))  # unknown: not asked
    assert line.startswith(f"wm: error: --node {node}") and says in line, line
    assert "expected http://HOST:PORT/health" in line


@pytest.mark.parametrize(
    "args",
    [
        ["worker", "create", "--topic", "t", "--mime-type", STUB],
        [
            "worker",
            "create",
            "--topic",
            "t",
            "--mime-type",
            STUB,
            "--base64",
            "e30=",
            "--setting",
            "no-equals-sign",
        ],
        ["worker", "list", "--status", "sleeping"],
        ["worker", "rollback", "w", "zero"],
        ["publish", "--source", "/s"],
        ["publish", "--event-file", "-", "--type", "t"],
        ["dlq", "purge", "abcdef", "--topic", "t"],
        ["dlq", "replay"],
        ["tail", "t", "--count", "0"],
        [],
    ],
)
def test_usage_errors_exit_2(env: dict[str, str], args: list[str]) -> None:
    result = wm(env, *args, expect=2)
    assert "Usage: wm" in result.err
    assert "Traceback" not in result.err


def test_bench_gets_its_command_line_verbatim(env: dict[str, str]) -> None:
    # --json and -h after ``bench`` are the benchmark's own: its help, not wm's.
    shown = wm(env, "--json", "bench", "--events", "10", "--json", "-h").out
    assert "--drain-repeats" in shown
    assert "Usage: wm bench" not in shown


def test_unmigrated_database_is_one_error_line(unmigrated_env: dict[str, str]) -> None:
    state = wm_json(unmigrated_env, "db", "current")
    assert state["current"] is None
    assert state["up_to_date"] is False
    assert "wm db upgrade" in one_error_line(wm(unmigrated_env, "worker", "list", expect=1))


@pytest.mark.slow
def test_db_upgrade_reaches_head(unmigrated_env: dict[str, str]) -> None:
    env = unmigrated_env
    assert "wm db upgrade" in one_error_line(wm(env, "worker", "list", expect=1))
    wm(env, "db", "upgrade")
    state = wm_json(env, "db", "current")
    assert state["current"] == state["head"]
    assert state["up_to_date"] is True
    assert "up to date" in wm(env, "db", "current").out


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_a_database_with_no_free_connection_says_so(env: dict[str, str], pg_url: str) -> None:
    """PostgreSQL refuses a connection past a limit (the server's, a role's, a database's);
    the error names the limit and what to do, not a missing migration."""
    import psycopg
    import sqlalchemy as sa

    role = f"wm_limited_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 1"))
    url = sa.make_url(env["WM_DATABASE_URL"]).set(username=role)
    held = psycopg.connect(url.set(drivername="postgresql").render_as_string(False))
    try:
        error = one_error_line(
            wm({**env, "WM_DATABASE_URL": url.render_as_string(False)}, "worker", "list", expect=1)
        )
    finally:
        held.close()
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP ROLE {role}"))
        admin.dispose()
    assert f"database postgresql+psycopg://{role}@" in error, error
    assert "has no free connection (connection failed:" in error, error
    assert f'too many connections for role "{role}"' in error, error
    assert "raise PostgreSQL's max_connections" in error, error
    assert "wm db upgrade" not in error, error


def test_config_prints_default_and_current_values(env: dict[str, str]) -> None:
    tuned = {**env, "GROUP_LOCK_MAX_RETRIES": "7"}
    rows = {r["variable"]: r for r in wm_json(tuned, "config")}
    assert rows["GROUP_LOCK_MAX_RETRIES"]["default"] == "3000"
    assert rows["GROUP_LOCK_MAX_RETRIES"]["current"] == "7"
    assert rows["WM_DATABASE_URL"]["current"] == env["WM_DATABASE_URL"]
    assert set(rows) == {variable for variable, _, _ in settings_table()}
    table = wm(tuned, "config").out.splitlines()
    assert table[0].split() == ["VARIABLE", "DEFAULT", "CURRENT", "MEANING"]
    assert any(line.split()[:3] == ["GROUP_LOCK_MAX_RETRIES", "3000", "7"] for line in table)


# -- events ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_publish_reaches_a_subscribed_queue(env: dict[str, str], tmp_path: Path) -> None:
    queue = wm_json(env, "subscribe", "orders", "sink")["queue"]
    reached = wm(
        env,
        "publish",
        "--type",
        "orders.placed",
        "--source",
        "/shop",
        "--topic",
        "orders",
        "--id",
        "evt-1",
        "--subject",
        "order-7",
        "--data",
        '{"amount": 12}',
        "--correlation-id",
        "corr-9",
        "--extension",
        "tenant=acme",
    )
    assert reached.out.strip() == "published evt-1 to orders: reached 1 subscription(s)"
    event_file = tmp_path / "event.json"
    event_file.write_text(encode(make_event("orders", "/file", {"n": 2}, id="evt-2")))
    assert wm_json(env, "publish", "--event-file", str(event_file))["reached"] == 1
    stdin_event = encode(make_event("orders", "/stdin", None, id="evt-3")).encode()
    assert wm_json(env, "publish", "--event-file", "-", stdin=stdin_event)["reached"] == 1

    listed = wm_json(env, "subscriptions", "--topic", "orders")
    assert listed == [{"topic": "orders", "queue": queue, "worker_id": None, "depth": 3}]
    first, second, third = drain_env(env, queue, 3)
    assert first["id"] == "evt-1"
    assert first["type"] == "orders.placed"
    assert first["subject"] == "order-7"
    assert first["data"] == {"amount": 12}
    assert (first["correlationid"], first["tenant"]) == ("corr-9", "acme")
    assert (second["id"], second["data"]) == ("evt-2", {"n": 2})
    assert third["source"] == "/stdin"

    wm(env, "unsubscribe", "orders", "sink")
    assert wm_json(env, "subscriptions") == []
    dropped = wm(env, "publish", "--type", "orders", "--source", "/shop")
    assert "dropped: topic has no subscriber" in dropped.out
    assert wm_json(env, "publish", "--type", "orders", "--source", "/shop")["reached"] == 0


def test_bad_event_data_is_one_error_line(env: dict[str, str]) -> None:
    result = wm(env, "publish", "--type", "t", "--source", "/s", "--data", "{oops", expect=1)
    assert "--data is not valid JSON" in one_error_line(result)
    result = wm(env, "publish", "--event-file", "-", stdin=b'{"type": "t"}', expect=1)
    assert "lacks required attribute" in one_error_line(result)


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_lifecycle_events_reach_a_subscribed_queue_in_order(
    env: dict[str, str], tmp_path: Path
) -> None:
    queue = wm_json(env, "subscribe", LIFECYCLE, "audit")["queue"]
    worker = create(env, tmp_path, "--name", "audited")["id"]
    wm(
        env,
        "worker",
        "update-code",
        worker,
        "--base64",
        base64.b64encode(stub(output_type="v2")).decode(),
    )
    wm(env, "worker", "rollback", "audited", "1")
    wm(env, "worker", "stop", worker)
    wm(env, "worker", "start", worker)
    wm(env, "worker", "delete", worker)

    kinds = ["created", "starting", "started", "code_updated", "code_updated", "stopping"]
    kinds += ["stopped", "starting", "started", "deleted"]
    events = drain_env(env, queue, len(kinds))
    assert [e["type"] for e in events] == [LIFECYCLE_TYPE + kind for kind in kinds]
    assert {e["subject"] for e in events} == {worker}
    assert [e["data"]["version"] for e in events[3:5]] == [2, 1]
    assert events[-1]["data"]["to_state"] == "deleted"
    wm(env, "unsubscribe", LIFECYCLE, "audit")


@pytest.mark.slow
def test_tail_prints_lifecycle_events_of_a_concurrent_create(
    env: dict[str, str], tmp_path: Path
) -> None:
    kinds = ["created", "starting", "started", "stopping", "stopped"]
    tail = start_tail(
        env, LIFECYCLE, "--json", "--count", str(len(kinds)), "--timeout-s", str(GUARD_S)
    )
    worker = create(env, tmp_path, "--name", "watched")["id"]
    wm(env, "worker", "stop", "watched")
    out, _ = finish(tail)

    events = [json.loads(line) for line in out.splitlines()]
    assert [e["type"] for e in events] == [LIFECYCLE_TYPE + kind for kind in kinds]
    assert {e["subject"] for e in events} == {worker}
    assert tail_queues(env, LIFECYCLE) == []


@pytest.mark.slow
def test_tail_human_line(env: dict[str, str]) -> None:
    tail = start_tail(env, "orders", "--count", "1")
    wm(
        env,
        "publish",
        "--type",
        "orders",
        "--source",
        "/s",
        "--id",
        "evt-7",
        "--subject",
        "order-7",
        "--correlation-id",
        "corr-7",
    )
    out, _ = finish(tail)
    when, *rest = out.split()
    assert rest == ["orders", "evt-7", "order-7", "corr-7"]
    assert when.endswith("Z")
    assert tail_queues(env, "orders") == []


@pytest.mark.slow
def test_tail_stops_after_a_quiet_period_and_cleans_up(env: dict[str, str]) -> None:
    assert wm(env, "tail", "orders", "--timeout-s", "1").out == ""
    assert wm_json(env, "subscriptions") == []


@pytest.mark.slow
def test_tail_cleans_up_on_ctrl_c(env: dict[str, str]) -> None:
    tail = start_tail(env, "orders")
    tail.send_signal(signal.SIGINT)
    _, err = finish(tail)
    assert "Traceback" not in err
    assert tail_queues(env, "orders") == []


#: ``wm tail`` with a stop signal sent at a moment of the test's choosing (argv[1]): right
#: after the subscription is made, before ``subscribe`` returns; or while it is removed,
#: after tail stopped by itself (``--timeout-s``).
SIGNALLED_TAIL = """
import os, signal, sys

from wm.cli import main
from wm.manager import WorkManager

moment = sys.argv.pop(1)
made, removed = WorkManager.subscribe, WorkManager.unsubscribe


def subscribe(self, *args, **kwargs):
    queue = made(self, *args, **kwargs)
    if moment == "subscribing":
        os.kill(os.getpid(), signal.SIGTERM)
    return queue


def unsubscribe(self, *args, **kwargs):
    if moment == "removing":
        os.kill(os.getpid(), signal.SIGTERM)
    return removed(self, *args, **kwargs)


WorkManager.subscribe, WorkManager.unsubscribe = subscribe, unsubscribe
sys.argv[0] = "wm"
raise SystemExit(main())
"""


@pytest.mark.parametrize("moment", ["subscribing", "removing"])
def test_tail_leaves_no_subscription_whenever_a_stop_signal_comes(
    env: dict[str, str], moment: str
) -> None:
    """A stop signal while ``wm tail`` makes its subscription, or (another one) while it
    removes it, leaves no queue behind to collect the topic's events."""
    done = subprocess.run(
        [sys.executable, "-c", SIGNALLED_TAIL, moment, "tail", "orders", "--timeout-s", "1"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=GUARD_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert tail_queues(env, "orders") == []
    assert wm_json(env, "subscriptions") == []


# -- dead letters ------------------------------------------------------------------------------


def park(env: dict[str, str], worker_id: str, topic: str, error_type: str) -> str:
    """Dead-letter one event the way the delivery task does."""
    settings = Settings.from_env(env)
    event = make_event(topic, "/test", {"n": 1})
    try:
        return DeadLetters(settings).park(
            Failure(
                topic=topic,
                worker_id=worker_id,
                envelope=encode(event),
                key=key_of(event),
                event_id=event.get_id(),
                error_type=error_type,
                error_message="it broke",
                attempts=3,
                version=1,
            )
        )
    finally:
        store.dispose_engines()


@pytest.mark.slow
def test_dead_letters_list_show_replay_purge(env: dict[str, str], tmp_path: Path) -> None:
    worker = create(env, tmp_path, "--name", "flaky")["id"]
    timeout = park(env, worker, "orders", "WorkerTimeout")
    crash = park(env, worker, "orders", "WorkerExecutionError")

    listed = wm_json(env, "dlq", "list", "--worker", "flaky")
    assert {d["id"] for d in listed} == {timeout, crash}
    assert [d["id"] for d in wm_json(env, "dlq", "list", "--error-type", "WorkerTimeout")] == [
        timeout
    ]
    shown = wm_json(env, "dlq", "show", timeout)
    assert shown["envelope"]["data"] == {"n": 1}  # the event as JSON, not JSON in a string
    assert "it broke" in wm(env, "dlq", "list").out

    queue = f"orders::{worker}"
    replayed = wm_json(env, "dlq", "replay", timeout, "--to-version", "same", "--rate", "100")
    assert replayed["replayed"] == 1
    depth = {s["queue"]: s["depth"] for s in wm_json(env, "subscriptions")}
    assert depth[queue] == 1
    assert [d["id"] for d in wm_json(env, "dlq", "list")] == [crash]
    assert [
        d["replay_count"] for d in wm_json(env, "dlq", "list", "--all") if d["id"] == timeout
    ] == [1]

    assert "--yes" in one_error_line(wm(env, "dlq", "purge", "--topic", "orders", expect=1))
    assert wm_json(env, "dlq", "purge", "--topic", "orders", "--yes")["purged"] == 2
    assert "no dead letter with id" in one_error_line(wm(env, "dlq", "show", crash, expect=1))


@pytest.mark.parametrize(("level", "shown"), [("WARNING", logging.ERROR), ("INFO", logging.INFO)])
def test_what_the_host_s_sandbox_lacks_is_left_to_the_nodes_logs(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, level: str, shown: int
) -> None:
    """A command that checks code in the sandbox probes this host; as a user without cgroups
    that printed two warnings on every ``wm worker create`` (the node's log has them)."""
    for name, value in {**env, "WM_LOG_LEVEL": level}.items():
        monkeypatch.setenv(name, value)
    assert main(["worker", "list"]) == 0
    assert {logging.getLogger(n).getEffectiveLevel() for n in HOST_PROBES} == {shown}
