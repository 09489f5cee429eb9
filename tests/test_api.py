"""The admin HTTP API (``wm api``) as an admin script in any language would use it: a real
server process on real services, with tokens from ``wm token create``."""

from __future__ import annotations

import base64
import json
import re
import select
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import psutil
import pytest
import redis
import schemathesis
import sqlalchemy as sa
from hypothesis import strategies as st
from schemathesis import GenerationMode, checks

from tests.conftest import env_of
from tests.helpers import STUB, drain, eventually, free_port, self_signed, stub, wm_cli
from wm import Settings, WorkManager, store
from wm.control.access import Tokens
from wm.dataplane.recovery import LEADER_KEY
from wm.ops import api as admin_api
from wm.views import Role

#: Who may call what: the calls only an admin may make, every other read for a viewer,
#: every other change for an operator. A route missing here fails the test below.
NEEDS = {
    ("GET", "/v1/whoami"): Role.VIEWER,
    ("GET", "/v1/health"): Role.VIEWER,
    ("GET", "/v1/status"): Role.VIEWER,
    ("GET", "/v1/workers"): Role.VIEWER,
    ("GET", "/v1/workers/{ref}"): Role.VIEWER,
    ("GET", "/v1/workers/{ref}/versions"): Role.VIEWER,
    ("GET", "/v1/workers/{ref}/transitions"): Role.VIEWER,
    ("GET", "/v1/workers/{ref}/details"): Role.VIEWER,
    ("GET", "/v1/workers/{ref}/sessions/{session}"): Role.VIEWER,
    ("GET", "/v1/workers/{ref}/code"): Role.OPERATOR,
    ("GET", "/v1/deadletters"): Role.VIEWER,
    ("GET", "/v1/deadletters/{letter_id}"): Role.VIEWER,
    ("POST", "/v1/workers"): Role.OPERATOR,
    ("POST", "/v1/workers/{ref}/start"): Role.OPERATOR,
    ("POST", "/v1/workers/{ref}/stop"): Role.OPERATOR,
    ("POST", "/v1/workers/{ref}/suspend"): Role.OPERATOR,
    ("POST", "/v1/workers/{ref}/resume"): Role.OPERATOR,
    ("PUT", "/v1/workers/{ref}/code"): Role.OPERATOR,
    ("POST", "/v1/workers/{ref}/rollback"): Role.OPERATOR,
    ("POST", "/v1/events"): Role.OPERATOR,
    ("POST", "/v1/deadletters/replay"): Role.OPERATOR,
    ("POST", "/v1/recover"): Role.OPERATOR,
    ("DELETE", "/v1/workers/{ref}"): Role.ADMIN,
    ("POST", "/v1/deadletters/purge"): Role.ADMIN,
    ("GET", "/v1/audit"): Role.ADMIN,
    ("GET", "/v1/schedules"): Role.VIEWER,
    ("POST", "/v1/schedules"): Role.OPERATOR,
    ("DELETE", "/v1/schedules/{schedule_id}"): Role.OPERATOR,
    ("GET", "/v1/subscriptions"): Role.VIEWER,
    ("GET", "/v1/subscriptions/{topic}/{name}/messages"): Role.VIEWER,
    ("GET", "/v1/tenants"): Role.ADMIN,
    ("GET", "/v1/database"): Role.VIEWER,
    ("PUT", "/v1/subscriptions/{topic}/{name}"): Role.OPERATOR,
    ("DELETE", "/v1/subscriptions/{topic}/{name}"): Role.OPERATOR,
    ("GET", "/v1/tokens"): Role.ADMIN,
    ("POST", "/v1/tokens"): Role.ADMIN,
    ("DELETE", "/v1/tokens/{token}"): Role.ADMIN,
}
#: Parked at the first failure, with the circuit breaker off (these tests want letters).
#: Neither the breaker nor health pauses these workers: their failures are what is looked at.
FAST = {"max_retries": 0, "timeout_s": 10, "failure_threshold": 0, "pause_when_unhealthy": False}
#: Inputs generated per operation when fuzzing, and what each answer is checked for.
FUZZ_EXAMPLES = 60
FUZZ_CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]


@dataclass
class Api:
    url: str
    settings: Settings
    tokens: dict[Role, str]
    process: subprocess.Popen[str]

    def client(self, role: Role | None = None, *, token: str | None = None) -> httpx.Client:
        secret = token or (self.tokens[role] if role else None)
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


#: The output of each ``wm api`` a test started, read as it comes (by a thread per server):
#: a pipe nobody reads fills up (64 KiB, some 600 access-log lines) and blocks the server.
_OUTPUT: dict[int, tuple[threading.Thread, list[str]]] = {}


def start_api(
    settings: Settings, *args: str, scheme: str = "http", verify: Any = True
) -> tuple[str, subprocess.Popen[str]]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "wm.cli", "api", "--port", str(port), *args],
        env=env_of(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    assert process.stdout is not None
    reader = threading.Thread(target=lines.extend, args=(process.stdout,), daemon=True)
    reader.start()
    _OUTPUT[process.pid] = (reader, lines)
    url = f"{scheme}://127.0.0.1:{port}"

    def up() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"wm api ended: {_output(process)}")
        try:
            return httpx.get(f"{url}/health/live", verify=verify).status_code == 200
        except httpx.TransportError:
            return False

    try:
        eventually(up, timeout_s=30)
    except BaseException:
        if process.poll() is None:
            process.kill()
            _output(process)
        raise
    return url, process


def _output(process: subprocess.Popen[str]) -> str:
    """Everything the (ended) server printed."""
    process.wait(timeout=30)
    reader, lines = _OUTPUT.pop(process.pid)
    reader.join(timeout=30)
    return "".join(lines)


def stop(process: subprocess.Popen[str]) -> str:
    process.terminate()
    return _output(process)


@pytest.fixture
def api(pg_settings: Settings) -> Iterator[Api]:
    tokens = {r: Tokens(pg_settings).create(f"test-{r.value}", r)[1] for r in Role}
    url, process = start_api(pg_settings)
    yield Api(url, pg_settings, tokens, process)
    out = stop(process)
    assert "Traceback" not in out, out


def test_every_call_needs_a_token_in_force_and_a_role_high_enough(api: Api) -> None:
    spec = httpx.get(f"{api.url}/openapi.json").json()
    routes = {
        (method.upper(), path)
        for path, operations in spec["paths"].items()
        for method in operations
        if path.startswith("/v1/")
    }
    assert routes == set(NEEDS)
    tokens = Tokens(api.settings)
    _, revoked = tokens.create("revoked", Role.ADMIN)
    tokens.revoke("revoked")
    _, expiring = tokens.create("expiring", Role.ADMIN, expires_in=timedelta(seconds=1))
    time.sleep(1.1)
    forged = api.tokens[Role.ADMIN][:-4] + "AAAA"
    for (method, path), needed in sorted(NEEDS.items()):
        target = path.format(
            ref="nobody",
            letter_id="nothing",
            schedule_id="nothing",
            topic="t",
            name="n",
            token="x",
            session="s",
        )
        for secret in (None, "not-a-token", forged, revoked, expiring):
            with api.client(token=secret) as client:
                reply = client.request(method, target, json={})
            assert reply.status_code == 401, (method, path, secret, reply.text)
            assert reply.headers["www-authenticate"].startswith("Bearer")
        for role in Role:
            with api.client(role) as client:
                reply = client.request(method, target, json={})
            if role.allows(needed):
                assert reply.status_code not in (401, 403), (method, path, role, reply.text)
            else:
                assert reply.status_code == 403, (method, path, role, reply.text)
                assert f"needs {needed.value}" in reply.json()["detail"]
    with api.client(Role.OPERATOR) as client:
        assert client.get("/v1/whoami").json()["name"] == "test-operator"


def test_a_worker_lives_its_whole_life_over_http_with_a_real_node(
    api: Api, start_node: Any
) -> None:
    queue = _subscribe(api.settings, "api.done")
    node = start_node(api.settings)
    with api.client(Role.OPERATOR) as http:
        created = http.post(
            "/v1/workers",
            json={
                "topic": "api.in",
                "mime_type": STUB,
                "name": "echo",
                "code_base64": base64.b64encode(stub(output_type="api.done")).decode(),
            },
        )
        assert created.status_code == 201, created.text
        worker = created.json()
        assert worker["status"] == "running" and worker["current_version"] == 1
        node.consuming(f"api.in::{worker['id']}")
        sent = http.post("/v1/events", json={"type": "api.in", "source": "/t", "data": {"n": 1}})
        assert sent.status_code == 202 and sent.json() == {"reached": 1}
        [out] = drain(api.settings, queue, 1)
        assert out["type"] == "api.done"

        updated = http.put("/v1/workers/echo/code", json={"code": "{}", "note": "v2"})
        assert updated.json()["current_version"] == 2, updated.text
        rolled = http.post("/v1/workers/echo/rollback", json={"version": 1})
        assert rolled.json()["current_version"] == 1
        assert http.post("/v1/workers/echo/stop").json()["status"] == "stopped"
        too_late = http.post("/v1/workers/echo/start", params={"delay_s": "6.8e307"})
        assert too_late.status_code == 422 and "at most 31536000" in too_late.text
        assert http.get("/v1/workers/echo").json()["status"] == "stopped"  # nothing written
        assert http.post("/v1/workers/echo/start").json()["status"] == "running"
        versions = http.get(f"/v1/workers/{worker['id']}/versions").json()
        assert [(v["version"], v["note"]) for v in versions] == [(1, "created"), (2, "v2")]
        reasons = [t["reason"] for t in http.get("/v1/workers/echo/transitions").json()]
        assert "rolled back from version 2 to version 1" in reasons
        assert http.delete("/v1/workers/echo").status_code == 403
    with api.client(Role.ADMIN) as http:
        assert http.delete("/v1/workers/echo").json()["status"] == "deleted"
        assert http.get("/v1/workers/echo").status_code == 404
        assert http.get("/v1/health").json()["status"] == "healthy"


def test_a_call_works_in_the_tenant_its_header_names(api: Api) -> None:
    """``WM-Tenant``: a worker created in one tenant is listed, found and published to in it
    alone; from another tenant its id answers exactly like a missing one; a tenant that does
    not exist is a 404 saying so, a malformed name a 422."""
    WorkManager(api.settings).create_tenant("acme")
    acme = WorkManager(api.settings, tenant="acme")
    queue = acme.subscribe("api.in", "tap")  # no node runs: the worker's queue fills
    body = {
        "topic": "api.in",
        "mime_type": STUB,
        "name": "echo",
        "code": '{"output_type": "api.done"}',
    }
    in_acme = {"WM-Tenant": "acme"}
    # Only a deployment-wide token names the tenant of its calls (issue 28, scoped tokens).
    _, every_tenant = Tokens(api.settings).create("every-tenant", Role.ADMIN, all_tenants=True)
    with api.client(token=every_tenant) as http:
        made = http.post("/v1/workers", json=body, headers=in_acme)
        assert made.status_code == 201, made.text
        worker = made.json()
        assert (worker["tenant"], worker["topic"]) == ("acme", "api.in")
        assert [w["id"] for w in http.get("/v1/workers", headers=in_acme).json()] == [worker["id"]]
        assert http.get("/v1/workers").json() == []
        missing = "00000000-0000-4000-8000-000000000000"
        for ref in (worker["id"], "echo"):
            foreign = http.get(f"/v1/workers/{ref}")
            assert foreign.status_code == 404
            gone = http.get(f"/v1/workers/{missing if ref == worker['id'] else 'nobody'}")
            expected = gone.json()["detail"].replace(missing, ref).replace("nobody", ref)
            assert foreign.json()["detail"] == expected
        event = {"type": "api.in", "source": "/t", "data": {"n": 1}}
        assert http.post("/v1/events", json=event).json() == {"reached": 0}
        assert http.post("/v1/events", json=event, headers=in_acme).json() == {"reached": 2}
        [out] = drain(api.settings, queue, 1)
        assert out["wmtenant"] == "acme"
        unknown = http.get("/v1/workers", headers={"WM-Tenant": "beta"})
        assert unknown.status_code == 404 and unknown.json()["type"] == "TenantNotFound"
        assert http.get("/v1/workers", headers={"WM-Tenant": "Bad!"}).status_code == 422


def test_a_list_of_events_is_published_in_order_and_a_bad_one_is_named(api: Api) -> None:
    """``POST /v1/events`` with a JSON list: one ``publish_many``; a bad event is a 422
    naming its index, and then none of the list is sent."""
    queue = WorkManager(api.settings).subscribe("api.many", "tap")
    events = [{"type": "api.many", "source": "/t", "id": f"e{n}", "data": n} for n in range(5)]
    lone = '{"type": "api.many", "source": "/t", "id": "\\udcff"}'
    lone_list = f'[{{"type": "api.many", "source": "/t"}}, {lone}]'
    with api.client(Role.OPERATOR) as http:
        sent = http.post("/v1/events", json=events)
        assert sent.status_code == 202 and sent.json() == {"reached": [1] * 5}, sent.text
        assert [e["id"] for e in drain(api.settings, queue, 6, timeout_s=5)] == [
            f"e{n}" for n in range(5)
        ]
        bad = http.post("/v1/events", json=[events[0], {"type": "api.many"}])
        assert bad.status_code == 422
        assert ["body", "events", 1, "source"] in [e["loc"] for e in bad.json()["detail"]]
        surrogate = http.post(
            "/v1/events", content=lone_list, headers={"Content-Type": "application/json"}
        )
        assert surrogate.status_code == 422, surrogate.text
        assert http.post("/v1/events", json=[]).json() == {"reached": []}
    assert drain(api.settings, queue, 1, timeout_s=1) == []


def test_recover_over_http_says_what_it_did_and_is_refused_while_one_runs(api: Api) -> None:
    WorkManager(api.settings).create_worker(code=stub(), mime_type=STUB, topic="in", name="w")
    with api.client(Role.OPERATOR) as http:
        done = http.post("/v1/recover")
        assert done.status_code == 200, done.text
        assert done.json()["queues_declared"] == 1 and done.json()["failures"] == []
        assert done.json()["holder"].startswith("api@")
        redis.Redis.from_url(api.settings.redis_url).set(LEADER_KEY, "celery@n/t", ex=60)
        busy = http.post("/v1/recover")
    assert busy.status_code == 409 and "celery@n" in busy.json()["detail"], busy.text


def test_dead_letters_are_listed_inspected_replayed_and_purged_over_http(
    api: Api, start_node: Any
) -> None:
    node = start_node(api.settings)
    with api.client(Role.OPERATOR) as http:
        worker = http.post(
            "/v1/workers",
            json={
                "topic": "api.fail",
                "mime_type": STUB,
                "name": "fails",
                "code": stub(fail="boom").decode(),
                "settings": FAST,
            },
        ).json()
        node.consuming(f"api.fail::{worker['id']}")
        for n in range(3):
            event = {"type": "api.fail", "source": "/t", "id": f"e{n}", "data": {"n": n}}
            http.post("/v1/events", json=event).raise_for_status()

        def parked() -> list[dict[str, Any]]:
            return list(http.get("/v1/deadletters", params={"worker": "fails"}).json())

        letters = eventually(lambda: len(found := parked()) == 3 and found)
        first = letters[0]["id"]
        one = http.get(f"/v1/deadletters/{first}").json()
        assert one["envelope"]["source"] == "/t"  # the event as JSON, not JSON in a string
        assert "boom" in one["error_message"] and one["worker_id"] == worker["id"]

        # Replayed to the same failing code: parked again, its replay counted.
        assert http.post("/v1/deadletters/replay", json={"ids": [first]}).json()["replayed"] == 1
        eventually(lambda: {d["id"]: d["replay_count"] for d in parked()}.get(first) == 1)

        # Repaired, then replayed by filter: every letter is delivered and stays replayed.
        http.put("/v1/workers/fails/code", json={"code": stub().decode()}).raise_for_status()
        fixed = http.post("/v1/deadletters/replay", json={"worker": "fails", "rate_per_s": 100})
        assert fixed.json()["replayed"] == 3, fixed.text
        eventually(lambda: parked() == [] or None)
        assert http.post("/v1/deadletters/purge", json={"topic": "api.fail"}).status_code == 403
    with api.client(Role.ADMIN) as http:
        everything = http.get("/v1/deadletters", params={"include_replayed": True}).json()
        assert sorted(d["replay_count"] for d in everything) == [1, 1, 2]
        assert http.post("/v1/deadletters/purge", json={"topic": "api.fail"}).json() == {
            "purged": 3
        }
        missing = http.get(f"/v1/deadletters/{first}")
        assert missing.status_code == 404 and missing.json()["type"] == "DeadLetterNotFound"


def test_invalid_input_is_refused_with_422_naming_the_field(api: Api) -> None:
    code = stub().decode()
    w, ok = "/v1/workers", {"topic": "t", "mime_type": STUB, "code": code}
    cases: list[tuple[str, str, dict[str, Any], list[str]]] = [
        ("POST", w, {"mime_type": STUB, "code": code}, ["body", "topic"]),
        ("POST", w, {**ok, "topic": "a::b"}, ["body", "topic"]),
        ("POST", w, {**ok, "mime_type": "x/y"}, ["body", "mime_type"]),
        (
            "POST",
            w,
            {"topic": "t", "mime_type": STUB, "code_base64": "!!"},
            ["body", "code_base64"],
        ),
        ("POST", w, {"topic": "t", "mime_type": STUB}, ["body"]),
        ("POST", w, {**ok, "url": "https://x"}, ["body"]),
        ("POST", w, {**ok, "settings": {"max_retries": -1}}, ["body"]),
        ("POST", w, {**ok, "colour": 1}, ["body", "colour"]),
        ("POST", w, {**ok, "group_mode": "all"}, ["body", "group_mode"]),
        ("POST", w, {**ok, "group_mode": "shared", "settings": {"group_mode": "x"}}, ["body"]),
        ("POST", f"{w}/x/rollback", {"version": 0}, ["body", "version"]),
        ("POST", "/v1/events?topic=a%3A%3Ab", {"type": "t", "source": "/s"}, ["query", "topic"]),
        ("POST", "/v1/events", {"source": "/s"}, ["body", "event", "type"]),
        ("POST", "/v1/events", [{"type": "t", "source": "/s"}, {}], ["body", "events", 1, "type"]),
        ("POST", "/v1/deadletters/replay", {"ids": ["a"], "topic": "t"}, ["body"]),
        ("POST", "/v1/deadletters/replay", {"ids": ["a"], "rate_per_s": 0}, ["body", "rate_per_s"]),
        ("GET", "/v1/deadletters?worker=nobody", {}, ["query", "worker"]),
        ("GET", "/v1/deadletters?limit=0", {}, ["query", "limit"]),
    ]
    with api.client(Role.ADMIN) as http:
        for method, path, body, loc in cases:
            reply = http.request(method, path, json=body if method != "GET" else None)
            assert reply.status_code == 422, (path, body, reply.text)
            locs = [error["loc"] for error in reply.json()["detail"]]
            assert loc in locs, (path, body, locs)
        refused = http.post("/v1/workers", json={"topic": "t", "mime_type": STUB, "code": "{"})
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "code"]
        assert http.get("/v1/workers").json() == []
        made = http.post(w, json={**ok, "group": "g", "group_mode": "shared", "start": False})
        assert made.status_code == 201 and made.json()["settings"] == {"group_mode": "shared"}


def test_every_change_is_audited_with_who_what_when_and_result(api: Api) -> None:
    with api.client(Role.OPERATOR) as http:
        http.post("/v1/workers", json={"topic": "t", "mime_type": STUB, "code": "{}", "name": "w"})
        http.post("/v1/workers/w/stop")
        http.delete("/v1/workers/w")  # refused: operator
        http.get("/v1/workers")  # a read: not audited
    with api.client() as http:
        http.post("/v1/workers/w/start")  # refused: no token, so nothing is written
    entries = wm_cli(api.settings, "audit")
    calls = [(e["token_name"], e["action"], e["status_code"]) for e in entries]
    assert calls == [
        ("test-operator", "POST /v1/workers", 201),
        ("test-operator", "POST /v1/workers/{ref}/stop ref=w", 200),
        ("test-operator", "DELETE /v1/workers/{ref} ref=w", 403),
    ]
    assert entries[0]["result"] == "ok" and entries[0]["role"] == "operator"
    assert "needs admin" in entries[2]["result"]
    assert all(e["at"].endswith("+00:00") and e["remote"] == "127.0.0.1" for e in entries)
    assert [e["action"] for e in wm_cli(api.settings, "audit", "--token", "nobody")] == []
    with api.client(Role.ADMIN) as http:
        assert len(http.get("/v1/audit?token=test-operator").json()) == 3
    assert (
        "ref=w"
        in subprocess.run(
            [sys.executable, "-m", "wm.cli", "audit"],
            env=env_of(api.settings),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )


def test_nothing_changes_when_the_audit_log_cannot_be_written(api: Api) -> None:
    with store.engine_for(api.settings).begin() as conn:
        conn.execute(sa.text("ALTER TABLE audit_log RENAME TO audit_log_away"))
    with api.client(Role.OPERATOR) as http:
        reply = http.post("/v1/workers", json={"topic": "t", "mime_type": STUB, "code": "{}"})
        assert reply.status_code == 503 and "audit log" in reply.json()["detail"]
        assert http.get("/v1/workers").json() == []


#: How far a request's body may get before the answer while the server reads none of it
#: (socket buffers on both sides), and the most the server may grow meanwhile.
UNREAD_BODY_BYTES = 16 << 20
FLAT_RSS_BYTES = 64 << 20
HUGE_BODY_BYTES = 256 << 20


def test_no_token_is_a_401_before_anything_is_read_or_stored(api: Api) -> None:
    """Finding 8: a NUL in the path was a 503 naming the database, unaudited; a 256 MB body
    was read and parsed (the API grew by 700 MiB) before the 401."""
    for method, path in [
        ("POST", "/v1/workers/a%00b/start"),
        ("GET", "/v1/workers/a%00b"),
        ("POST", "/v1/no/such/path"),
        ("GET", "/nothing-here"),
    ]:
        reply = httpx.request(method, f"{api.url}{path}", content=b"{not json")
        assert reply.status_code == 401, (method, path, reply.text)
        _names_no_database(api.settings, reply.text)
    assert wm_cli(api.settings, "audit") == []

    server = psutil.Process(api.process.pid)
    before = server.memory_info().rss
    head = _head("POST", "/v1/workers", {"Content-Length": str(HUGE_BODY_BYTES)})
    answer, sent = _send_until_answered(api.url, head, HUGE_BODY_BYTES, finish=True)
    assert answer.startswith(b"HTTP/1.1 401 "), answer
    assert sent["before_answer"] < UNREAD_BODY_BYTES, sent
    assert server.memory_info().rss - before < FLAT_RSS_BYTES
    chunked = _head("POST", "/v1/events", {"Transfer-Encoding": "chunked"})
    answer, sent = _send_until_answered(api.url, chunked, HUGE_BODY_BYTES, chunked=True)
    assert answer.startswith(b"HTTP/1.1 401 "), answer
    assert sent["before_answer"] < UNREAD_BODY_BYTES, sent


def test_a_body_over_the_limit_is_a_413_before_it_is_read(api: Api) -> None:
    """The default WM_API_MAX_BODY_BYTES (1 MiB) holds whether the body says its length or
    streams in chunks; the role is checked before the body is parsed; each is audited."""
    limit = Settings().api_max_body_bytes
    auth = {"Authorization": f"Bearer {api.tokens[Role.OPERATOR]}"}
    declared = _head("POST", "/v1/workers", {**auth, "Content-Length": str(HUGE_BODY_BYTES)})
    answer, sent = _send_until_answered(api.url, declared, HUGE_BODY_BYTES)
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert b"WM_API_MAX_BODY_BYTES" in answer and sent["before_answer"] < UNREAD_BODY_BYTES
    streamed = _head("PUT", "/v1/workers/w/code", {**auth, "Transfer-Encoding": "chunked"})
    answer, sent = _send_until_answered(api.url, streamed, HUGE_BODY_BYTES, chunked=True)
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert sent["before_answer"] < UNREAD_BODY_BYTES, sent

    with api.client(Role.OPERATOR) as http:
        body = json.dumps({"topic": "t", "mime_type": STUB, "code": "{}"}).encode()
        fits = body[:-1] + b" " * (limit - len(body)) + b"}"
        assert http.post("/v1/workers", content=fits, headers=_JSON).status_code == 201
        assert http.post("/v1/workers", content=fits + b" ", headers=_JSON).status_code == 413
    with api.client(Role.VIEWER) as http:
        reply = http.post("/v1/workers", content=b"{not json", headers=_JSON)
        assert reply.status_code == 403, reply.text
    audited = [(e["token_name"], e["status_code"]) for e in wm_cli(api.settings, "audit")]
    assert audited == [
        ("test-operator", 413),
        ("test-operator", 413),
        ("test-operator", 201),
        ("test-operator", 413),
        ("test-viewer", 403),
    ]


def test_a_crash_is_a_500_on_record_and_an_outage_names_no_database(
    pg_settings: Settings,
) -> None:
    """A handler that raises is a 500 that says nothing of the cause, and its audit entry is
    finished with 500. With the database gone, a call without a token is still a 401 (the
    database is not touched before the token) and one with a token is a 503 naming nothing
    of the database."""
    token = Tokens(pg_settings).create("ops", Role.OPERATOR)[1]
    app = admin_api.create_app(pg_settings)

    def crash() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/v1/crash", crash, methods=["POST"])
    with _serving(app) as url:
        reply = httpx.post(f"{url}/v1/crash", headers={"Authorization": f"Bearer {token}"})
    assert reply.status_code == 500 and "a bug" not in reply.text, reply.text
    [entry] = wm_cli(pg_settings, "audit")
    assert (entry["action"], entry["status_code"], entry["result"]) == (
        "POST /v1/crash",
        500,
        "RuntimeError: a bug",
    )

    gone = pg_settings.replace(
        database_url=f"postgresql+psycopg://secretuser@127.0.0.1:{free_port()}/secretdb"
    )
    with _serving(admin_api.create_app(gone)) as url:
        assert httpx.post(f"{url}/v1/workers/a%00b/start").status_code == 401
        auth = {"Authorization": f"Bearer {token}"}
        reply = httpx.post(f"{url}/v1/workers/a%00b/start", headers=auth)
    assert reply.status_code == 503, reply.text
    _names_no_database(gone, reply.text)


_JSON = {"Content-Type": "application/json"}


@contextmanager
def _serving(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn in this process (for an app a test has changed)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        eventually(lambda: server.started, timeout_s=30, interval_s=0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _names_no_database(settings: Settings, text: str) -> None:
    url = sa.make_url(settings.database_url)
    names = [url.drivername, url.username, url.host, str(url.port), url.database, "psycopg"]
    assert not [n for n in names if n and n in text], text


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *_lines({**_JSON, **headers})]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _lines(headers: dict[str, str]) -> list[str]:
    return [f"{name}: {value}" for name, value in headers.items()]


def _send_until_answered(
    url: str, head: bytes, total: int, *, chunked: bool = False, finish: bool = False
) -> tuple[bytes, dict[str, int]]:
    """Send ``head``, then up to ``total`` body bytes in 64 KiB pieces until the server
    answers (and on to ``total`` with ``finish``, as far as the server takes them): the
    answer's first bytes, and how much body went out before it and in all."""
    piece = b"x" * (64 << 10)
    framed = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
    port = int(url.rsplit(":", 1)[1])
    sent = {"before_answer": 0, "all": 0}
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        pending = memoryview(b"")
        while sent["all"] < total:
            readable, writable, _ = select.select([sock], [sock], [], 30)
            if readable:
                data = sock.recv(4096)
                answer += data
                if not data or not finish:
                    break
                continue
            if not writable:
                raise AssertionError(f"the server neither reads nor answers: {sent}")
            pending = pending or memoryview(framed)
            try:
                count = sock.send(pending)
            except OSError:  # the server closed the connection: it takes no more
                break
            pending = pending[count:]
            sent["all"] += count
            sent["before_answer"] += 0 if answer else count
        sock.settimeout(30)
        if not answer:
            answer = sock.recv(4096)
        answer = _whole_answer(sock, answer)
    return answer, sent


def _whole_answer(sock: socket.socket, answer: bytes) -> bytes:
    """``answer`` read on to the end of its body (its head and body may come apart)."""
    while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
        try:
            data = sock.recv(4096)
        except OSError:  # reset after the answer: what came is all there is
            break
        if not data:
            break
        answer += data
    return answer


def _length(answer: bytes) -> int:
    head = answer.partition(b"\r\n\r\n")[0].lower()
    found = re.search(rb"content-length: *(\d+)", head)
    return int(found.group(1)) if found else 0


def test_tokens_are_stored_as_hashes_and_revoked_at_once(api: Api) -> None:
    made = wm_cli(api.settings, "token", "create", "--name", "ci", "--role", "viewer")
    secret = made["token"]
    with store.engine_for(api.settings).connect() as conn:
        stored = conn.execute(sa.text("SELECT * FROM api_tokens")).all()
    assert secret not in json.dumps([list(map(str, row)) for row in stored])
    with api.client(token=secret) as http:
        assert http.get("/v1/workers").status_code == 200
        listed = wm_cli(api.settings, "token", "list")
        assert {t["name"]: t["role"] for t in listed}["ci"] == "viewer"
        assert "token" not in listed[0]
        wm_cli(api.settings, "token", "revoke", "ci")
        assert http.get("/v1/workers").status_code == 401
    again = wm_cli(api.settings, "token", "create", "--name", "ci", "--role", "admin")
    assert again["id"] != made["id"]
    duplicate = subprocess.run(
        [sys.executable, "-m", "wm.cli", "token", "create", "--name", "ci", "--role", "admin"],
        env=env_of(api.settings),
        capture_output=True,
        text=True,
    )
    assert duplicate.returncode == 1
    assert duplicate.stderr == "wm: error: a token named 'ci' is in force; revoke it first\n"


def test_the_server_refuses_clear_text_beyond_loopback(
    pg_settings: Settings, tmp_path: Path
) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "wm.cli", "api", "--bind", "0.0.0.0", "--port", str(free_port())],
        env=env_of(pg_settings),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1
    assert refused.stderr.startswith("wm: error: refusing to serve the admin API on 0.0.0.0")
    assert "Traceback" not in refused.stderr

    url, process = start_api(pg_settings, "--bind", "0.0.0.0", "--insecure")
    stop(process)

    cert, key = self_signed(tmp_path)
    trusted = ssl.create_default_context(cafile=str(cert))
    url, process = start_api(
        pg_settings,
        "--bind", "0.0.0.0", "--tls-cert", str(cert), "--tls-key", str(key),
        scheme="https", verify=trusted,
    )  # fmt: skip
    try:
        assert httpx.get(f"{url}/v1/workers", verify=trusted).status_code == 401
    finally:
        stop(process)


def _subscribe(settings: Settings, topic: str) -> str:
    from wm.manager import WorkManager

    return WorkManager(settings).subscribe(topic, "api-test")


# -- fuzzing from the API's own OpenAPI description ----------------------------------------


def test_fuzzing_finds_no_server_error_and_no_way_past_the_roles(api: Api) -> None:
    """Every operation of the API's own OpenAPI description, with inputs generated from its
    schema (valid and invalid): an admin's call never meets a 5xx and gets only documented
    answers of the documented shape; the same call without a token is 401, and with a role
    below the one needed is 403. Schemathesis generates; Hypothesis runs each operation's
    examples, seeded from the test (``derandomize``) so a failure reproduces."""
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} >= set(NEEDS)
    for operation in operations:
        # Invalid input only in bodies: a query string carries text, so "?group=false" is a
        # valid group name, not the boolean the generator meant to send.
        modes = GenerationMode if operation.body else [GenerationMode.POSITIVE]
        admin = _bearer(api, Role.ADMIN)  # fixed, so generated cases vary everything else
        cases = st.one_of(*(operation.as_strategy(mode, headers=admin) for mode in modes))
        hypothesis.settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        )(hypothesis.given(case=cases)(lambda case: _fuzz_once(api, case)))()


def _fuzz_once(api: Api, case: Any) -> None:
    case.call_and_validate(checks=FUZZ_CHECKS)  # as an admin
    needed = NEEDS.get((case.method.upper(), case.operation.path))
    if needed is None:  # the unauthenticated liveness probe
        return
    case.headers = {k: v for k, v in case.headers.items() if k.lower() != "authorization"}
    lower = [r for r in Role if not r.allows(needed)]
    for headers, expected in [({}, 401), *[(_bearer(api, r), 403) for r in lower]]:
        reply = case.call(headers=headers)
        assert reply.status_code == expected, (case.path, headers, reply.text)


def _bearer(api: Api, role: Role) -> dict[str, str]:
    return {"Authorization": f"Bearer {api.tokens[role]}"}


def test_a_lone_surrogate_in_a_request_gets_a_clear_answer_and_a_finished_audit_row(
    api: Api,
) -> None:
    """A lone surrogate in a request's JSON once ended in a 500 (the 422 that echoed it could
    not be encoded) and left its audit row unfinished."""
    admin = api.client(Role.ADMIN)
    lone = '"\\udcff"'  # JSON's escape of a lone surrogate
    bodies = {
        "/v1/workers": f'{{"topic": {lone}, "mime_type": "{STUB}", "code": "{{}}"}}',
        "/v1/events": f'{{"type": "in", "source": "/t", "id": {lone}}}',
    }
    for path, body in bodies.items():
        reply = admin.post(path, content=body, headers={"Content-Type": "application/json"})
        assert reply.status_code == 422, reply.text
        assert "\\udcff" in reply.text
    data = f'{{"type": "in", "source": "/t", "data": {{"x": {lone}}}}}'
    published = admin.post("/v1/events", content=data, headers={"Content-Type": "application/json"})
    assert published.status_code == 202, published.text

    # a call's audit row is finished as its response goes out, so the last may lag a moment
    def finished() -> bool:
        audit = admin.get("/v1/audit").json()
        return bool(audit) and all(entry["status_code"] is not None for entry in audit)

    eventually(finished, timeout_s=5)


def test_subscriptions_and_tokens_are_managed_over_http(api: Api) -> None:
    """A plain subscription made, fed, listed and removed; a token made by a tenant's admin
    works at once, is listed, and stops working when revoked."""
    with api.client(Role.OPERATOR) as http:
        made = http.put("/v1/subscriptions/api.subs/inbox")
        assert made.status_code == 200, made.text
        queue = made.json()["queue"]
        assert made.json() == {"topic": "api.subs", "name": "inbox", "queue": queue}
        assert http.put("/v1/subscriptions/api.subs/inbox").json() == made.json()  # idempotent
        http.post("/v1/events", json={"type": "api.subs", "source": "/t"}).raise_for_status()
        listed = http.get("/v1/subscriptions", params={"topic": "api.subs"}).json()
        assert listed == [{"topic": "api.subs", "queue": queue, "worker_id": None, "depth": 1}]
        assert http.delete("/v1/subscriptions/api.subs/inbox").json() == {"purged": 1}
        gone = http.delete("/v1/subscriptions/api.subs/inbox")
        assert gone.status_code == 404, gone.text
        assert "has no subscription named 'inbox'" in gone.json()["detail"]
        assert http.get("/v1/subscriptions", params={"topic": "api.subs"}).json() == []
    with api.client(Role.ADMIN) as http:
        created = http.post("/v1/tokens", json={"name": "made-over-http", "role": "viewer"})
        assert created.status_code == 201, created.text
        token, secret = created.json()["token"], created.json()["secret"]
        assert (token["role"], token["tenant"]) == ("viewer", "default")
        again = http.post("/v1/tokens", json={"name": "made-over-http", "role": "viewer"})
        assert again.status_code == 422 and "is in force" in again.text
        assert "made-over-http" in [t["name"] for t in http.get("/v1/tokens").json()]
        with api.client(token=secret) as viewer:
            assert viewer.get("/v1/whoami").json()["id"] == token["id"]
            assert http.delete(f"/v1/tokens/{token['id']}").json()["revoked_at"] is not None
            assert viewer.get("/v1/whoami").status_code == 401
        assert "made-over-http" not in [t["name"] for t in http.get("/v1/tokens").json()]
        assert http.delete("/v1/tokens/made-over-http").status_code == 404


# -- the server as its operator sees it (issue 29, point 9) ------------------------------------


def _requests(url: str, process: subprocess.Popen[str], secret: str) -> str:
    """Two calls, the token's and a forged one's; the server's output once it stopped."""
    try:
        for shown, code in ((secret, 200), ("wm_forged", 401)):
            reply = httpx.get(f"{url}/v1/workers", headers={"Authorization": f"Bearer {shown}"})
            assert reply.status_code == code
    finally:
        out = stop(process)
    return out


def test_api_says_where_it_listens_and_logs_each_request(pg_settings: Settings) -> None:
    token, secret = Tokens(pg_settings).create("logged", Role.VIEWER)
    url, process = start_api(pg_settings)
    out = _requests(url, process, secret)
    lines = out.splitlines()
    assert lines[0] == f"wm api listening on {url} (docs: {url}/docs, console: {url}/console/)", out
    assert re.search(rf"GET /v1/workers 200 [\d.]+ ms token={token.id}$", out, re.M), out
    assert re.search(r"GET /v1/workers 401 [\d.]+ ms$", out, re.M), out
    assert secret not in out and "wm_forged" not in out


def test_api_logs_json_lines_with_log_format_json(pg_settings: Settings) -> None:
    token, secret = Tokens(pg_settings).create("logged", Role.VIEWER)
    url, process = start_api(pg_settings.replace(log_format="json"))
    out = _requests(url, process, secret)
    records = [json.loads(line) for line in out.splitlines()]  # every line is JSON
    assert (
        records[0]["message"]
        == f"wm api listening on {url} (docs: {url}/docs, console: {url}/console/)"
    )
    calls = [r for r in records if r.get("path") == "/v1/workers"]
    assert [(r["method"], r["status"], r["token_id"]) for r in calls] == [
        ("GET", 200, token.id),
        ("GET", 401, None),
    ]
    assert all(r["duration_ms"] >= 0 for r in calls)
    assert secret not in out


def test_api_on_a_taken_port_is_one_error_line(pg_settings: Settings) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "wm.cli", "api", "--port", str(port)],
            env=env_of(pg_settings),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(f"wm: error: port {port} on 127.0.0.1 is taken ("), line
    assert line.endswith("); pass --port or set WM_API_PORT"), line


def test_a_stop_waits_for_a_stalled_request_only_the_shutdown_grace(pg_settings: Settings) -> None:
    """A request whose client stalls in the middle of its body is in flight for ever: a stop
    (SIGTERM) waits for it WM_SHUTDOWN_GRACE_S, then ends it and the server."""
    settings = pg_settings.replace(shutdown_grace_s=2.0)
    _, token = Tokens(settings).create("stalling", Role.OPERATOR)
    url, process = start_api(settings)
    port = int(url.rsplit(":", 1)[1])
    head = (
        "POST /v1/events HTTP/1.1\r\nHost: api\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {token}\r\nContent-Length: 1000\r\n\r\n["
    )
    with socket.create_connection(("127.0.0.1", port)) as stalled:
        stalled.sendall(head.encode())
        time.sleep(1.0)  # the token is checked; the handler waits for the rest of the body
        process.terminate()
        try:
            process.wait(timeout=20)  # for ever without the grace: the client never goes
        finally:
            out = stop(process)
    assert process.returncode == -signal.SIGTERM, out  # uvicorn ends by the signal it got
    assert "timeout graceful shutdown exceeded" in out and "Traceback" not in out, out
