"""docker-compose.yml, Dockerfile and .dockerignore: what ``docker compose up`` will be handed.

No Docker engine runs in CI, so the stack is checked the way an engine would first read it:
``docker-compose config`` validates the file against the Compose schema, and the parsed YAML
must describe the services, ordering and environment the README promises.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
APP_SERVICES = ("migrate", "worker", "flower")
APP_ENVIRONMENT = {
    "WM_DATABASE_URL": "postgresql+psycopg://workmanager:workmanager@postgres:5432/workmanager",
    "WM_BROKER_URL": "redis://redis:6379/0",
    "WM_REDIS_URL": "redis://redis:6379/1",
}


#: Services started only with ``--profile``: name -> its profiles.
PROFILES = {
    "rabbitmq": ["rabbitmq"],
    "prometheus": ["monitoring"],
    "grafana": ["monitoring"],
}


@pytest.fixture(scope="module")
def compose_binary() -> str:
    """docker-compose; its absence fails in CI and only skips on a developer machine."""
    path = shutil.which("docker-compose")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install docker-compose (apt-get install docker-compose)")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    return path


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    parsed = yaml.safe_load(COMPOSE_FILE.read_text())
    result: dict[str, Any] = parsed["services"]
    return result


def _config(compose_binary: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "WORKMANAGER_IMAGE"}
    return subprocess.run(
        [
            compose_binary,
            "--project-directory",
            str(ROOT),
            "-f",
            str(COMPOSE_FILE),
            "config",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_compose_file_is_valid(compose_binary: str) -> None:
    result = _config(compose_binary, "-q")
    assert result.returncode == 0, result.stderr


def test_resolved_config_has_the_stack(compose_binary: str) -> None:
    result = _config(compose_binary)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]
    core = {"redis", "postgres", "migrate", "worker", "flower"}
    assert set(resolved) == core | set(PROFILES)
    assert {name: resolved[name].get("profiles") for name in PROFILES} == PROFILES
    for name in APP_SERVICES:
        assert resolved[name]["environment"] == APP_ENVIRONMENT | _own(name), name
        assert resolved[name]["image"] == "workmanager:local", name
        assert "build" in resolved[name], name


def test_backing_services(services: dict[str, Any]) -> None:
    assert services["redis"]["image"] == "redis:7"
    assert "redis-cli" in services["redis"]["healthcheck"]["test"]
    postgres = services["postgres"]
    assert postgres["image"] == "postgres:16"
    assert postgres["environment"] == {
        "POSTGRES_DB": "workmanager",
        "POSTGRES_USER": "workmanager",
        "POSTGRES_PASSWORD": "workmanager",
    }
    assert "pg_isready" in postgres["healthcheck"]["test"]


def test_app_services_share_one_image_and_environment(services: dict[str, Any]) -> None:
    images = {services[name]["image"] for name in APP_SERVICES}
    assert len(images) == 1
    for name in APP_SERVICES:
        assert services[name]["environment"] == APP_ENVIRONMENT | _own(name), name


def _own(service: str) -> dict[str, str]:
    """Settings a service adds to the shared ones: a node's health endpoints."""
    if service == "worker":
        return {"WM_HEALTH_PORT": "8001", "WM_HEALTH_BIND": "0.0.0.0"}
    return {}


def test_workers_are_checked_through_their_readiness_endpoint(services: dict[str, Any]) -> None:
    check = services["worker"]["healthcheck"]
    assert "http://127.0.0.1:8001/health/ready" in " ".join(check["test"])
    assert check["interval"] and check["retries"] >= 1


def test_migrate_runs_once_after_postgres_is_ready(services: dict[str, Any]) -> None:
    migrate = services["migrate"]
    assert migrate["command"] == ["wm", "db", "upgrade"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"] == {"postgres": {"condition": "service_healthy"}}


def test_workers_wait_for_migrations_and_redis_and_scale(services: dict[str, Any]) -> None:
    worker = services["worker"]
    assert worker["command"] == [
        "celery",
        "-A",
        "wm.celeryapp",
        "worker",
        "--loglevel=INFO",
    ]
    depends = worker["depends_on"]
    assert depends["migrate"] == {"condition": "service_completed_successfully"}
    assert depends["redis"] == {"condition": "service_healthy"}
    # --scale worker=3 needs replicas that do not clash on a name or a host port.
    assert "container_name" not in worker
    assert "ports" not in worker


def test_flower_is_published_on_5555(services: dict[str, Any]) -> None:
    flower = services["flower"]
    assert flower["command"] == ["celery", "-A", "wm.celeryapp", "flower", "--port=5555"]
    assert any(str(port).endswith("5555:5555") for port in flower["ports"])
    assert flower["depends_on"]["redis"] == {"condition": "service_healthy"}


def test_dockerfile_installs_the_package_as_a_non_root_user() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    assert instructions[0] == "FROM python:3.11-slim AS base"
    assert any(
        "pip install" in line and "[postgres,flower,native,dotnet,otel]" in line
        for line in instructions
    )
    users = [line.split()[1] for line in instructions if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    # the default image is the last stage, the base; --target with-dotnet adds the SDK
    assert instructions[-1] == "FROM base"
    stage = instructions[instructions.index("FROM base AS with-dotnet") :]
    assert any(
        line.startswith("COPY --from=mcr.microsoft.com/dotnet/sdk:8.0 /usr/share/dotnet")
        for line in stage
    )


def test_dockerignore_keeps_what_the_build_needs() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", "tests", ".wm"} <= ignored
    needed = {"pyproject.toml", "README.md", "wm", "engines", "migrations", "celeryconfig.py"}
    assert not needed & ignored


def test_every_service_has_a_memory_limit(services: dict[str, Any]) -> None:
    assert [name for name, service in services.items() if "mem_limit" not in service] == []


def test_the_monitoring_profile_scrapes_every_worker_and_shows_the_dashboard(
    services: dict[str, Any],
) -> None:
    scrape = yaml.safe_load((ROOT / "ops" / "prometheus" / "prometheus.yml").read_text())
    [job] = scrape["scrape_configs"]
    assert job["dns_sd_configs"] == [{"names": ["worker"], "type": "A", "port": 8001}]
    assert services["worker"]["environment"]["WM_HEALTH_PORT"] == "8001"
    mounts = services["grafana"]["volumes"]
    assert any(m.startswith("./ops/grafana/workmanager.json:") for m in mounts)
    for mount in [*mounts, *services["prometheus"]["volumes"]]:
        assert (ROOT / mount.split(":")[0]).exists(), mount
