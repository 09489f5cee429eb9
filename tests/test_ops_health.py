"""A node's health endpoints and ``wm health``, on real node processes (prefork) and real
services: healthy, degraded by a worker whose code cannot load there, unhealthy while its
Redis is down and healthy again once it is back; a taken port stops the node with a line
naming WM_HEALTH_PORT."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from engines.python.isolation import WANTED_LAYERS, kernel_isolation, limit_layers
from tests.conftest import env_of
from tests.helpers import STUB, eventually, free_port, stub
from wm import Settings, WorkManager, make_event, store
from wm.lifecycle import Status
from wm.local.embedded import find_redis_server, start_redis, stop_redis
from wm.store.models import WorkerVersion


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            return int(reply.status), json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _wm_health(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wm.cli", "health", *args],
        env=env_of(settings),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def state_redis(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A Redis server of the test's own for the state store: (URL, its server handle)."""
    server = start_redis(tmp_path / "state-redis", executable=find_redis_server())
    yield f"redis://127.0.0.1:{server.port}/0", server
    stop_redis(server)


@pytest.mark.slow
def test_a_node_reports_healthy_then_degraded_by_code_it_cannot_load(
    pg_settings: Settings, start_node: Any
) -> None:
    port = free_port()
    settings = pg_settings.replace(health_port=port)
    node = start_node(settings, name="health")
    base = f"http://127.0.0.1:{port}"
    assert _get(f"{base}/health/live") == (
        200,
        {"status": "alive", "node": node.hostname},
    )
    code, found = eventually(lambda: (r := _get(f"{base}/health"))[1]["status"] == "healthy" and r)
    assert code == 200 and found["reasons"] == [] and found["consuming"] is True
    assert {name: check["ok"] for name, check in found["checks"].items()} == {
        "broker": True,
        "redis": True,
        "database": True,
    }
    assert found["recovery"]["state"] in ("done", "elsewhere")
    assert _get(f"{base}/health/ready")[0] == 200
    assert _get(f"{base}/nothing")[0] == 404

    # the Python sandbox's layers (and limit layers) as the node's own probe found them, the
    # same as here
    layers = kernel_isolation().layers
    assert found["engines"]["text/x-python"] == {
        "sandbox_layers": list(layers),
        "sandbox_missing": [name for name in WANTED_LAYERS if name not in layers],
        "limit_layers": list(limit_layers()),
    }
    assert "network namespace" in layers  # bubblewrap is installed where the tests run

    cli = _wm_health(settings)
    assert cli.returncode == 0, cli.stderr
    assert "status:" in cli.stdout and "healthy" in cli.stdout and "broker:" in cli.stdout
    [python] = [line for line in cli.stdout.splitlines() if line.startswith("text/x-python:")]
    assert python.endswith(
        f"sandbox layers: {', '.join(layers)}; sandbox missing: none; "
        f"limit layers: {', '.join(limit_layers())}"
    )

    # code accepted at create time that no longer loads: the worker fails, the node degrades
    manager = WorkManager(settings)
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="health.in")
    node.consuming(f"health.in::{worker.id}")
    with store.session_scope(settings) as session:
        session.execute(
            update(WorkerVersion)
            .where(WorkerVersion.worker_id == worker.id)
            .values(code=stub(retired_key=1))
        )
    manager.publish(make_event("health.in", "/tests", {"n": 1}))
    eventually(lambda: manager.get_worker(worker.id).status == Status.FAILED, timeout_s=20)
    code, found = _get(f"{base}/health")
    assert (code, found["status"]) == (200, "degraded"), found
    assert list(found["engine_failures"]) == [str(worker.id)]
    assert found["engine_failures"][str(worker.id)].startswith("InvalidCode:")
    assert any("cannot load here" in reason for reason in found["reasons"])
    assert _get(f"{base}/health/ready")[0] == 200  # still serving its other workers
    cli = _wm_health(settings, "--node", f"{base}/health", "--json")
    assert cli.returncode == 1 and json.loads(cli.stdout)["status"] == "degraded"


@pytest.mark.slow
def test_a_node_whose_redis_is_down_is_unhealthy_until_it_is_back(
    pg_settings: Settings, start_node: Any, state_redis: tuple[str, Any], tmp_path: Path
) -> None:
    url, server = state_redis
    port = free_port()
    settings = pg_settings.replace(health_port=port, redis_url=url)
    start_node(settings, name="redisdown")
    health = f"http://127.0.0.1:{port}/health"
    eventually(lambda: _get(health)[1]["status"] == "healthy")

    stop_redis(server)
    code, found = _get(health)
    assert (code, found["status"]) == (503, "unhealthy")
    assert found["checks"]["redis"]["ok"] is False
    assert any(r.startswith("redis unreachable at WM_REDIS_URL=") for r in found["reasons"])
    assert _get(health + "/ready")[0] == 503
    assert _get(health + "/live")[0] == 200  # alive: no reason to restart the node
    cli = _wm_health(settings, "--node", health)
    assert cli.returncode == 2 and "FAILED" in cli.stdout

    restarted = start_redis(
        tmp_path / "state-redis", port=server.port, executable=find_redis_server()
    )
    try:
        eventually(lambda: _get(health)[1]["status"] == "healthy", timeout_s=30)
    finally:
        stop_redis(restarted)


@pytest.mark.slow
def test_a_taken_port_stops_the_node_with_a_line_naming_the_setting(
    pg_settings: Settings, start_node: Any
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AssertionError, match=f"WM_HEALTH_PORT={port} .*cannot listen there"):
            start_node(pg_settings.replace(health_port=port), name="taken")


def test_wm_health_without_a_node_says_what_to_pass(pg_settings: Settings) -> None:
    cli = _wm_health(pg_settings.replace(health_port=0))
    assert cli.returncode == 3  # not asked: a monitor's UNKNOWN
    assert "pass --node URL, or set WM_HEALTH_PORT" in cli.stderr
    port = free_port()  # nothing listens there
    cli = _wm_health(pg_settings, "--node", f"http://127.0.0.1:{port}/health")
    assert (
        cli.returncode == 3
        and f"no health answer from http://127.0.0.1:{port}/health" in cli.stderr
    )


def test_a_runtime_out_of_support_degrades_the_node_while_workers_use_it(
    settings: Settings,
) -> None:
    """An engine whose facts say its runtime is out of support (the .NET engines') is a
    reason for ``degraded`` while live workers of that engine exist, not merely installed."""
    from engines.dotnet import runtime
    from engines.dotnet.engine import CSharpEngine
    from wm.ops.health import unsupported_runtimes

    stale = {"runtime": "Microsoft.NETCore.App 8.0.4 in /x", "support_ends": "2026-11-10"}
    facts = {STUB: {**stale, "supported": False}}
    assert unsupported_runtimes(settings, facts) == []  # installed, no worker uses it
    manager = WorkManager(settings)
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="rt.in")
    [reason] = unsupported_runtimes(settings, facts)
    assert reason.startswith(f"{STUB} workers run on Microsoft.NETCore.App 8.0.4 in /x")
    assert "out of Microsoft's support since 2026-11-10" in reason
    assert unsupported_runtimes(settings, {STUB: {**stale, "supported": True}}) == []
    manager.delete_worker(worker.id)
    assert unsupported_runtimes(settings, facts) == []
    # the .NET engines' facts: the runtime a node's processes would start
    shown = CSharpEngine.host_facts(settings)
    root = runtime.discover()
    assert shown["runtime"] == root.label and shown["supported"] == root.supported()
