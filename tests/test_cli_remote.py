"""``wm``'s read commands through the admin API (``WM_API_URL``, ``WM_API_TOKEN``): the same
answers as reading the deployment directly, errors that name the problem, and no command that
changes anything running against a store it was not pointed at."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cli_env import one_error_line, wm, wm_json
from tests.conftest import env_of
from tests.helpers import STUB, free_port, self_signed, stub
from tests.test_api import start_api, stop
from tests.test_cli_dlq import park
from wm import Settings, WorkManager, store
from wm.control import tenants
from wm.control.access import Tokens
from wm.events import make_event
from wm.views import Role


@dataclass
class World:
    settings: Settings
    url: str
    tokens: dict[Role, str]
    kept: str
    gone: str
    letter: str

    @property
    def direct(self) -> dict[str, str]:
        return env_of(self.settings)

    def remote(self, role: Role = Role.ADMIN, **extra: str) -> dict[str, str]:
        """No database, broker or Redis of the deployment: only the API and a token."""
        env = env_of(self.settings, WM_API_URL=self.url, WM_API_TOKEN=self.tokens[role])
        for name in ("WM_DATABASE_URL", "WM_BROKER_URL", "WM_REDIS_URL"):
            env.pop(name)
        env.update(extra)
        return env


@pytest.fixture
def world(pg_settings: Settings) -> Iterator[World]:
    manager = WorkManager(pg_settings)
    kept = str(manager.create_worker(code=stub(), mime_type=STUB, topic="orders", name="kept").id)
    manager.load_code_from_content(kept, stub(output_type="done"), note="second")
    gone = str(manager.create_worker(code=stub(), mime_type=STUB, topic="orders", name="gone").id)
    manager.add_schedule(kept, event_type="tick", every_s=60)
    manager.subscribe("orders", "inbox")
    for n in range(3):  # no node runs: they wait in the inbox (and the workers' queues)
        manager.publish(make_event("orders", "/tests", {"n": n}))
    letter = park(pg_settings, kept, "WorkerTimeout", "timed out", 0)
    park(pg_settings, gone, "WorkerTimeout", "timed out", 1)
    manager.delete_worker(gone)
    tokens = {r: Tokens(pg_settings).create(f"remote-{r.value}", r)[1] for r in Role}
    store.dispose_engines()
    url, process = start_api(pg_settings)
    yield World(pg_settings, url, tokens, kept, gone, letter)
    out = stop(process)
    assert "Traceback" not in out, out


def reads(world: World) -> list[tuple[str, ...]]:
    return [
        ("worker", "list"),
        ("worker", "list", "--status", "deleted"),
        ("worker", "show", "kept"),
        ("worker", "history", "kept"),
        ("worker", "history", world.gone),
        ("worker", "transitions", "kept"),
        ("worker", "code", "kept"),
        ("worker", "code", "kept", "--version", "1"),
        ("session", "show", "kept", "s1"),
        ("schedule", "list"),
        ("subscriptions",),
        ("dlq", "list"),
        ("dlq", "list", "--worker", "kept"),
        ("dlq", "show", world.letter),
        ("token", "list"),
        ("audit",),
        ("status",),
        ("tenant", "list"),
        ("db", "current"),
    ]


#: Fields that change between two reads of the same deployment: when a token was last used
#: (the remote reads use one), when the status was taken, and a breaker's or window's clock.
VOLATILE = {"last_used_at", "at", "since"}


def steady(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: steady(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [steady(v) for v in value]
    return value


def test_each_read_answers_through_the_api_as_it_does_directly(world: World) -> None:
    for command in reads(world):
        direct = wm_json(world.direct, *command)
        remote = wm_json(world.remote(), *command)
        assert steady(remote) == steady(direct), command
    # what a person reads: the same tables and blocks
    for command in [("worker", "list"), ("worker", "history", "kept"), ("dlq", "list")]:
        assert wm(world.remote(), *command).out == wm(world.direct, *command).out, command
    raw = wm(world.remote(), "worker", "code", "kept", "--version", "1").raw
    assert raw == wm(world.direct, "worker", "code", "kept", "--version", "1").raw == stub()
    # a look into a subscription (--json: one event a line), which leaves the messages queued
    for flags in [(), ("--json",), ("--json", "--count", "2")]:
        peek = ("consume", "orders", "--name", "inbox", "--peek", *flags)
        remote_lines = wm(world.remote(), *peek).out.splitlines()
        assert remote_lines == wm(world.direct, *peek).out.splitlines()
        assert len(remote_lines) == (2 if "--count" in flags else 3), remote_lines
    taken = wm(world.direct, "--json", "consume", "orders", "--name", "inbox").out.splitlines()
    assert [json.loads(line)["data"] for line in taken] == [{"n": 0}, {"n": 1}, {"n": 2}]


def test_a_refusal_reads_as_the_direct_one_and_names_what_to_fix(world: World) -> None:
    nobody = "0b0b0b0b-0000-4000-8000-000000000000"  # no worker has it
    for command in [
        ("worker", "show", "nosuch"),
        ("dlq", "show", "nosuch"),
        ("session", "show", nobody, "s1"),
    ]:
        remote = one_error_line(wm(world.remote(), *command, expect=1))
        assert remote == one_error_line(wm(world.direct, *command, expect=1))
    refused = one_error_line(
        wm(world.remote(WM_API_TOKEN="wm_nosuch_x"), "worker", "list", expect=1)
    )
    assert world.url in refused and "WM_API_TOKEN" in refused
    viewer = one_error_line(wm(world.remote(Role.VIEWER), "token", "list", expect=1))
    assert "admin" in viewer
    down = f"http://127.0.0.1:{free_port()}"
    silent = one_error_line(wm(world.remote(WM_API_URL=down), "status", expect=1))
    assert f"WM_API_URL={down} does not answer" in silent
    bad = one_error_line(wm(world.remote(WM_API_URL="ftp://x"), "worker", "list", expect=1))
    assert "WM_API_URL" in bad and "https://HOST:PORT" in bad


def test_a_change_without_the_deployments_database_is_refused_not_made_elsewhere(
    world: World,
) -> None:
    remote = world.remote()
    for command in [
        ("worker", "suspend", "kept"),
        ("tenant", "create", "elsewhere"),
        ("db", "upgrade"),
        ("consume", "orders", "--name", "inbox"),
    ]:
        refused = one_error_line(wm(remote, *command, expect=1))
        assert "WM_DATABASE_URL is not set" in refused and world.url in refused, command
    assert "elsewhere" not in {t["name"] for t in wm_json(world.direct, "tenant", "list")}
    assert wm_json(world.direct, "worker", "show", "kept")["status"] == "running"
    # with the deployment's database given too, the change is made there
    both = {**remote, "WM_DATABASE_URL": world.settings.database_url}
    both.update(WM_BROKER_URL=world.settings.broker_url, WM_REDIS_URL=world.settings.redis_url)
    wm(both, "worker", "suspend", "kept")
    assert wm_json(world.remote(), "worker", "show", "kept")["status"] == "suspended"


def test_config_masks_the_token(world: World) -> None:
    shown = {row["variable"]: row for row in wm_json(world.remote(), "config")}
    assert shown["WM_API_TOKEN"]["current"] == "**"
    assert world.tokens[Role.ADMIN] not in json.dumps(shown)
    assert shown["WM_API_URL"]["current"].rstrip("/") == world.url


def test_a_tenants_token_lists_its_own_tenant_only(world: World) -> None:
    tenants.create(world.settings, "acme")
    _, acme = Tokens(world.settings).create("acme-admin", Role.ADMIN, tenant="acme")
    store.dispose_engines()
    listed = wm_json(world.remote(WM_API_TOKEN=acme), "tenant", "list")
    assert [t["name"] for t in listed] == ["acme"]
    assert {t["name"] for t in wm_json(world.direct, "tenant", "list")} == {"acme", "default"}
    # it reads its own tenant's workers: none, not the default tenant's
    assert wm_json(world.remote(WM_API_TOKEN=acme), "worker", "list") == []


def test_an_https_api_is_trusted_through_the_systems_cas_or_ssl_cert_file(
    world: World, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    trusted = ssl.create_default_context(cafile=str(cert))
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    url, process = start_api(world.settings, *tls, scheme="https", verify=trusted)
    try:
        untrusted = one_error_line(wm(world.remote(WM_API_URL=url), "worker", "list", expect=1))
        assert f"WM_API_URL={url} has a certificate this machine does not trust" in untrusted
        assert "self-signed certificate" in untrusted and "SSL_CERT_FILE" in untrusted
        answered = wm_json(world.remote(WM_API_URL=url, SSL_CERT_FILE=str(cert)), "worker", "list")
        assert [w["name"] for w in answered] == ["kept"]
    finally:
        stop(process)
