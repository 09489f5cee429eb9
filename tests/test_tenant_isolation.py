"""Tenants as an attacker sees them (docs/guides/tenants.md, "Tokens and isolation"): two tenants
with a token of every role each and a deployment-wide admin, against a real API server
process, a real node and real services. Every route of the API, enumerated from the
application, is tried with tenant A's tokens against tenant B's objects (by id, short id and
name) and against missing ones: the answers are the same. Then schemathesis, with A's admin
token and B's ids as path parameters: no answer holds B's data, none is a 2xx for B's
objects."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.conftest import env_of
from tests.helpers import STUB, eventually, stub, wm_cli
from tests.test_api import start_api, stop
from wm import InvalidArgument, Settings, TenantInUse, TenantNotFound, WorkManager
from wm.control import tenants
from wm.control.access import Tokens
from wm.ops import api as admin_api
from wm.views import Role

A, B, MISSING_TENANT = "acme", "beta", "gamma"
#: Strings only tenant B's objects hold, which A never sends: no answer to A may contain
#: one (B's ids and worker name A does send, and its own audit entries echo them).
B_SECRETS = (
    '"b-in"',
    "beta::",
    "beta-secret",
    "beta.tick",
    "b-tap",
    "boom-beta",
    *(f"{B}-{r.value}" for r in Role),
)
#: Parked at the first failure, breaker and health pause off (the test wants a letter).
FAST = {"max_retries": 0, "timeout_s": 10, "failure_threshold": 0, "pause_when_unhealthy": False}
#: How a route that takes a reference outside its path gets one: the query parameter or
#: body field that carries it, and the body around it. A route with no path parameter and
#: none of these takes no reference (a listing, health, publishing); each such route is
#: named below, so a new route fails the test until it is placed.
REFERENCE_IN: dict[tuple[str, str], tuple[str, str, Any]] = {
    ("GET", "/v1/deadletters"): ("query", "worker", None),
    ("GET", "/v1/schedules"): ("query", "worker", None),
    ("POST", "/v1/schedules"): ("body", "worker", {"event_type": "x", "every_s": 60}),
    ("POST", "/v1/deadletters/replay"): ("body", "ids", {}),
    ("POST", "/v1/deadletters/purge"): ("body", "ids", {}),
    ("GET", "/v1/audit"): ("query", "token", None),
}
NO_REFERENCE = {
    ("GET", "/v1/whoami"),
    ("GET", "/v1/health"),
    ("GET", "/v1/status"),
    ("GET", "/v1/workers"),
    ("POST", "/v1/workers"),
    ("POST", "/v1/events"),
    ("POST", "/v1/recover"),
    ("GET", "/health/live"),
    ("GET", "/v1/subscriptions"),
    ("GET", "/v1/tokens"),
    ("POST", "/v1/tokens"),
    ("GET", "/v1/tenants"),
    ("GET", "/v1/database"),
}
#: Routes whose path names a thing in the caller's own tenant, which they make or remove:
#: A's call with B's topic makes (removes) A's own subscription, and B's stays as it was.
OWN_NAMESPACE = {
    ("PUT", "/v1/subscriptions/{topic}/{name}"),
    ("DELETE", "/v1/subscriptions/{topic}/{name}"),
}
#: The subscription name a subscription route is tried with (B's, on the topic given).
B_SUBSCRIPTION = "b-tap"
#: The body each path route needs to get as far as looking its object up.
BODIES: dict[tuple[str, str], Any] = {
    ("PUT", "/v1/workers/{ref}/code"): {"code": stub().decode()},
    ("POST", "/v1/workers/{ref}/rollback"): {"version": 1},
}
#: Examples schemathesis generates per operation.
FUZZ_EXAMPLES = 12


@dataclass
class World:
    url: str
    settings: Settings
    #: (tenant, role) → token secret; (None, admin): the deployment-wide admin.
    tokens: dict[tuple[str | None, Role], str]
    #: Path parameter → B's references to it (id, short id, and name where it has one).
    b_refs: dict[str, list[str]]
    #: B's objects' ids, for the counts before and after.
    b_worker: str
    b_letter: str
    b_schedule: str

    def client(self, tenant: str | None, role: Role, **headers: str) -> httpx.Client:
        bearer = {"Authorization": f"Bearer {self.tokens[tenant, role]}"}
        return httpx.Client(base_url=self.url, headers={**bearer, **headers}, timeout=30)


@pytest.fixture
def world(pg_settings: Settings, start_node: Any) -> Iterator[World]:
    """Tenants A and B, each with a worker, and B's with a schedule, a plain subscription, a
    dead letter and audit entries; a token of every role in each, one deployment-wide."""
    settings = pg_settings
    for name in (A, B):
        tenants.create(settings, name)
    tokens: dict[tuple[str | None, Role], str] = {
        (t, r): Tokens(settings).create(f"{t}-{r.value}", r, tenant=t)[1]
        for t in (A, B)
        for r in Role
    }
    tokens[None, Role.ADMIN] = Tokens(settings).create("root", Role.ADMIN, all_tenants=True)[1]
    WorkManager(settings, tenant=A).create_worker(
        code=stub(), mime_type=STUB, topic="a-in", name="a-orders", start=False
    )
    b = WorkManager(settings, tenant=B)
    fails = stub(fail="boom-beta").decode()
    node = start_node(settings)
    url, process = start_api(settings)
    with httpx.Client(base_url=url, timeout=30) as http:
        http.headers["Authorization"] = f"Bearer {tokens[B, Role.OPERATOR]}"
        made = http.post(
            "/v1/workers",
            json={"topic": "b-in", "mime_type": STUB, "name": "b-orders", "code": fails}
            | {"settings": FAST},
        )
        assert made.status_code == 201, made.text
        worker = made.json()["id"]
        node.consuming(f"{B}::b-in::{worker}")
        event = {"type": "b-in", "source": "/t", "data": {"beta-secret": 1}}
        http.post("/v1/events", json=event).raise_for_status()
        [letter] = eventually(lambda: b.dead_letters.list() or None, timeout_s=30)
    schedule = b.add_schedule(worker, event_type="beta.tick", every_s=3600).id
    b.subscribe("b-in", "b-tap")
    yield World(
        url,
        settings,
        tokens,
        {
            "ref": [worker, worker[:8], "b-orders"],
            "letter_id": [letter.id, letter.id[:8]],
            "schedule_id": [schedule, schedule[:8]],
            "topic": ["b-in"],
            "token": [f"{B}-{r.value}" for r in Role],
        },
        worker,
        letter.id,
        schedule,
    )
    assert "Traceback" not in stop(process)


def _missing_like(reference: str) -> str:
    """A reference of the same form as ``reference`` that names nothing."""
    if re.fullmatch(r"[0-9a-f-]{36}", reference):
        return str(uuid.UUID(int=uuid.UUID(reference).int ^ (1 << 64)))
    if re.fullmatch(r"[0-9a-f]+", reference):
        return f"{int(reference, 16) ^ 0x1111:0{len(reference)}x}"
    return "b-nobody"


def _answer(reply: httpx.Response, reference: str) -> tuple[int, str]:
    """Status and body, the reference sent (which the body may echo) blanked out."""
    return reply.status_code, reply.text.replace(reference, "<ref>")


def _routes() -> list[tuple[str, str]]:
    """Every operation of the application, from the description it generates of its routes
    (a route left out of it would still need a token: no route is)."""
    app = admin_api.create_app(Settings.from_env({}))
    paths = app.openapi()["paths"]
    return sorted((method.upper(), path) for path, ops in paths.items() for method in ops)


def _request(
    world: World, http: httpx.Client, method: str, path: str, reference: str
) -> httpx.Response:
    """``method path`` with ``reference`` where the route takes one (the path, a query
    parameter or a body field)."""
    params = re.findall(r"{(\w+)}", path)
    if params:
        target = path.replace(f"{{{params[0]}}}", reference).replace("{name}", B_SUBSCRIPTION)
        return http.request(method, target, json=BODIES.get((method, path), {}))
    where, name, body = REFERENCE_IN[method, path]
    if where == "query":
        return http.request(method, path, params={name: reference})
    value = [reference] if name == "ids" else reference
    return http.request(method, path, json={**body, name: value})


def test_tenant_a_s_tokens_find_nothing_of_tenant_b_on_any_route(world: World) -> None:
    """Every route with a reference, tried by each of A's tokens with each of B's references
    and a missing one of the same form: the same status and body. Routes without one show
    none of B's data, and B's objects are all there afterwards."""
    routes = _routes()
    placed = {r for r in routes if "{" in r[1]} | set(REFERENCE_IN) | NO_REFERENCE
    assert set(routes) <= placed, f"place each new route: {set(routes) - placed}"
    tried = 0
    for role in Role:
        with world.client(A, role) as http:
            for method, path in routes:
                if (method, path) in NO_REFERENCE:
                    reply = http.request(method, path, json={} if method != "GET" else None)
                    assert not any(s in reply.text for s in B_SECRETS), (path, reply.text)
                    continue
                param = (re.findall(r"{(\w+)}", path) or [None])[0]
                refs = world.b_refs[param] if param else _body_refs(world, method, path)
                for ref in refs:
                    missing = _missing_like(ref)
                    theirs = _answer(_request(world, http, method, path, ref), ref)
                    nothing = _answer(_request(world, http, method, path, missing), missing)
                    assert theirs == nothing, (role, method, path, ref, theirs, nothing)
                    own = (method, path) in OWN_NAMESPACE
                    assert theirs[0] not in range(200, 300) or method == "GET" or own, theirs
                    tried += 1
    assert tried > 100
    _b_is_intact(world)


def _body_refs(world: World, method: str, path: str) -> list[str]:
    """B's references a body or query route takes: its letters', its tokens' names, or its
    worker's."""
    if path == "/v1/audit":
        return [f"{B}-{r.value}" for r in Role]
    if REFERENCE_IN[method, path][1] == "ids":
        return world.b_refs["letter_id"]
    return world.b_refs["ref"]


def _b_is_intact(world: World) -> None:
    b = WorkManager(world.settings, tenant=B)
    assert b.get_worker(world.b_worker).status == "running"
    assert [d.id for d in b.dead_letters.list()] == [world.b_letter]
    assert [s.id for s in b.list_schedules()] == [world.b_schedule]
    plain = [s["queue"] for s in b.list_subscriptions("b-in") if s["worker_id"] is None]
    assert plain == [f"{B}::b-in::sub::{B_SUBSCRIPTION}"]
    listed = {t.name: t.tenant for t in Tokens(world.settings).list()}
    assert {n: t for n, t in listed.items() if n.startswith(B)} == {
        f"{B}-{r.value}": B for r in Role
    }


def test_a_tenant_s_token_works_in_its_tenant_alone_and_the_deployment_wide_in_any(
    world: World,
) -> None:
    """Naming another tenant in WM-Tenant is a 403 alike for an existing and a missing
    tenant; the status, the audit log and whoami show the token's tenant only; the
    deployment-wide admin names any tenant, and its calls are audited in that tenant."""
    for role in Role:
        with world.client(A, role) as http:
            for method, path in [("GET", "/v1/workers"), ("POST", "/v1/recover")]:
                there = http.request(method, path, headers={"WM-Tenant": B})
                nowhere = http.request(method, path, headers={"WM-Tenant": MISSING_TENANT})
                assert there.status_code == 403, there.text
                assert (there.status_code, there.text) == (nowhere.status_code, nowhere.text)
            own = http.get("/v1/workers", headers={"WM-Tenant": A})
            assert [w["name"] for w in own.json()] == ["a-orders"]
            assert http.get("/v1/whoami").json()["tenant"] == A
    with world.client(A, Role.VIEWER) as http:
        status = http.get("/v1/status").json()
        assert (status["workers"], status["dead_letters"]) == (1, {}), status
    with world.client(B, Role.VIEWER) as http:
        status = http.get("/v1/status").json()
        assert (status["workers"], status["dead_letters"]) == (1, {"b-in": 1}), status
        assert [q["topic"] for q in status["deepest_queues"] or []] in ([], ["b-in"])
    with world.client(A, Role.OPERATOR) as http:
        report = http.post("/v1/recover").json()
        assert (report["queues_declared"], report["workers_checked"]) == (1, 0), report
    with world.client(A, Role.ADMIN) as http:
        http.post("/v1/workers/a-orders/start").raise_for_status()
        audit = http.get("/v1/audit").json()
        assert {e["tenant"] for e in audit} == {A}, audit
        assert {e["token_name"] for e in audit} >= {"acme-admin", "acme-operator"}
        assert not any(s in json.dumps(audit) for s in B_SECRETS)
    with world.client(None, Role.ADMIN) as root:
        assert root.get("/v1/whoami").json()["tenant"] is None
        assert root.get(f"/v1/workers/{world.b_worker}").status_code == 404  # default tenant
        in_b = root.get(f"/v1/workers/{world.b_worker}", headers={"WM-Tenant": B})
        assert in_b.json()["name"] == "b-orders"
        gone = root.get("/v1/workers", headers={"WM-Tenant": MISSING_TENANT})
        assert gone.status_code == 404 and gone.json()["type"] == "TenantNotFound"
        root.post("/v1/workers/b-orders/suspend", headers={"WM-Tenant": B}).raise_for_status()
    with world.client(B, Role.ADMIN) as http:
        audit = http.get("/v1/audit", params={"token": "root"}).json()
        assert [(e["tenant"], e["action"]) for e in audit] == [
            (B, "POST /v1/workers/{ref}/suspend ref=b-orders")
        ]


def test_schemathesis_with_a_s_admin_token_finds_nothing_of_b(world: World) -> None:
    """Generated calls of every operation, A's admin token fixed, B's ids as the path
    parameters, with and without ``WM-Tenant: beta``: never a 2xx for B's object or in B's
    tenant, never B's data in an answer."""
    schema = schemathesis.openapi.from_url(f"{world.url}/openapi.json")
    bearer = {"Authorization": f"Bearer {world.tokens[A, Role.ADMIN]}"}
    for operation in (result.ok() for result in schema.get_all_operations()):
        names = [p.name for p in operation.path_parameters]
        refs = [{names[0]: r} for r in world.b_refs[names[0]]] if names else [{}]
        modes = GenerationMode if operation.body else [GenerationMode.POSITIVE]
        cases = st.one_of(
            *(
                operation.as_strategy(mode, headers=headers, path_parameters=path)
                for mode in modes
                for path in refs
                for headers in (bearer, {**bearer, "WM-Tenant": B})
            )
        )
        on_b = bool(names) and (operation.method.upper(), operation.path) not in OWN_NAMESPACE
        hypothesis.settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        )(hypothesis.given(case=cases)(lambda case: _probe(world, case, on_b)))()  # noqa: B023
    _b_is_intact(world)


def _probe(world: World, case: Any, on_b_object: bool) -> None:
    reply = case.call()
    text = reply.text
    for sent in (r for refs in world.b_refs.values() for r in refs):  # A sent them
        text = text.replace(sent, "<ref>")
    assert not any(s in text for s in B_SECRETS), (case.formatted_path, reply.text)
    in_b = case.headers.get("WM-Tenant") == B and case.path != "/health/live"  # public
    if on_b_object or in_b:
        assert not 200 <= reply.status_code < 300, (case.formatted_path, reply.text)


def test_tokens_belong_to_a_tenant_and_tenants_are_deleted_only_when_empty(
    pg_settings: Settings,
) -> None:
    """A token of a tenant that does not exist is refused; only an admin token may be
    deployment-wide; ``wm token list`` shows each token's tenant; ``wm tenant delete``
    names what remains, never deletes the default tenant, and deletes an empty one."""
    settings = pg_settings
    tokens = Tokens(settings)
    with pytest.raises(TenantNotFound, match=r"no tenant 'acme'.*wm tenant create acme"):
        tokens.create("a", Role.VIEWER, tenant=A)
    tenants.create(settings, A)
    for role in (Role.VIEWER, Role.OPERATOR):
        with pytest.raises(InvalidArgument, match=f"only an admin.*not a {role.value} one"):
            tokens.create("wide", role, all_tenants=True)
    with pytest.raises(InvalidArgument, match=r"one tenant .* or in all of them, not both"):
        tokens.create("wide", Role.ADMIN, tenant=A, all_tenants=True)
    assert tokens.create("old-style", Role.ADMIN)[0].tenant == "default"
    made = wm_cli(
        settings, "token", "create", "--name", "a-op", "--role", "operator", "--tenant", A
    )
    assert made["tenant"] == A
    wide = wm_cli(settings, "token", "create", "--name", "root", "--role", "admin", "--all-tenants")
    assert wide["tenant"] is None
    listed = {t["name"]: t["tenant"] for t in wm_cli(settings, "token", "list")}
    assert listed == {"old-style": "default", "a-op": A, "root": None}
    assert " * " in _wm(settings, "token", "list").stdout
    refused = _wm(settings, "token", "create", "--name", "x", "--role", "viewer", "--all-tenants")
    assert refused.returncode != 0 and "only an admin token" in refused.stderr

    WorkManager(settings, tenant=A).create_worker(
        code=stub(), mime_type=STUB, topic="in", name="orders", start=False
    )
    WorkManager(settings, tenant=A).subscribe("in", "tap")
    with pytest.raises(TenantInUse) as refusal:
        tenants.delete(settings, A)
    said = str(refusal.value)
    assert "live workers: orders" in said and "subscriptions: acme::in::sub::tap" in said, said
    assert "tokens in force: a-op" in said, said
    kept = _wm(settings, "tenant", "delete", A)
    assert kept.returncode != 0 and "nothing was deleted" in kept.stderr, kept.stderr
    with pytest.raises(TenantInUse, match="always exists"):
        tenants.delete(settings, "default")
    with pytest.raises(TenantNotFound):
        tenants.delete(settings, MISSING_TENANT)
    a = WorkManager(settings, tenant=A)
    a.delete_worker("orders")
    a.unsubscribe("in", "tap")
    tokens.revoke("a-op")
    assert wm_cli(settings, "tenant", "delete", A) == {"deleted": A}
    assert [t.name for t in tenants.listing(settings)] == ["default"]


def _wm(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wm.cli", *args],
        env=env_of(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
