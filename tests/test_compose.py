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
APP_SERVICES = ("migrate", "worker", "beat", "api", "flower")
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
    core = {"redis", "postgres", "migrate", "worker", "beat", "api", "flower"}
    assert set(resolved) == core | set(PROFILES)
    assert {name: resolved[name].get("profiles") for name in PROFILES} == PROFILES
    for name in APP_SERVICES:
        env_files = {"FLOWER_BASIC_AUTH": "operator:workmanager"} if name == "flower" else {}
        assert resolved[name]["environment"] == APP_ENVIRONMENT | env_files | _own(name), name
        assert resolved[name]["image"] == "workmanager:local", name
        assert "build" in resolved[name], name


def test_backing_services(services: dict[str, Any]) -> None:
    assert services["redis"]["image"] == "redis:7"
    assert "redis-cli" in services["redis"]["healthcheck"]["test"]
    postgres = services["postgres"]
    assert postgres["image"] == "postgres:16"
    assert postgres["env_file"] == "${WM_COMPOSE_ENV_DIR:-./ops/compose}/postgres.env"
    assert "pg_isready" in postgres["healthcheck"]["test"]


def test_no_password_is_written_in_the_compose_file(compose_binary: str) -> None:
    """Passwords come from env files (ops/compose, or WM_COMPOSE_ENV_DIR): none is a literal
    of docker-compose.yml, and the resolved stack still has them."""
    text = COMPOSE_FILE.read_text()
    assert "PASSWORD" not in text and ":workmanager@" not in text
    resolved = yaml.safe_load(_config(compose_binary).stdout)["services"]
    assert resolved["postgres"]["environment"]["POSTGRES_PASSWORD"] == "workmanager"
    assert resolved["worker"]["environment"]["WM_DATABASE_URL"].startswith(
        "postgresql+psycopg://workmanager:workmanager@postgres:5432/"
    )


def test_app_services_share_one_image_and_environment(services: dict[str, Any]) -> None:
    images = {services[name]["image"] for name in APP_SERVICES}
    assert len(images) == 1
    shared = "${WM_COMPOSE_ENV_DIR:-./ops/compose}/workmanager.env"
    for name in APP_SERVICES:
        env_file = services[name]["env_file"]
        assert (env_file if name == "flower" else [env_file])[0] == shared, name
        assert services[name].get("environment", {}) == _own(name), name
        assert services[name]["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in services[name]["security_opt"], name


def _own(service: str) -> dict[str, str]:
    """Settings a service adds to the shared ones: a node's health endpoints, its sizing,
    and the sandbox layers it requires."""
    if service == "worker":
        return {
            "WM_HEALTH_PORT": "8001",
            "WM_HEALTH_BIND": "0.0.0.0",
            "WM_NODE_CONCURRENCY": "2",
            "WM_ENGINE_CACHE_MB": "1024",
            "WM_SANDBOX_REQUIRE": "user namespace,mount namespace,pid namespace,ipc namespace,"
            "uts namespace,network namespace,no capabilities,dies with its host,seccomp",
        }
    return {}


def test_workers_keep_every_sandbox_layer(services: dict[str, Any]) -> None:
    """bubblewrap, unprivileged, needs the namespaces and mounts Docker's default seccomp and
    AppArmor profiles refuse; the node requires every layer the sandbox knows."""
    from engines.python.isolation import WANTED_LAYERS

    worker = services["worker"]
    assert {"seccomp=unconfined", "apparmor=unconfined"} <= set(worker["security_opt"])
    required = worker["environment"]["WM_SANDBOX_REQUIRE"].split(",")
    assert sorted(required) == sorted(WANTED_LAYERS)


def test_the_beat_runs_after_migrations_with_the_database_scheduler(
    services: dict[str, Any],
) -> None:
    from wm.config import Settings
    from wm.dataplane.app import celery_settings

    beat = services["beat"]
    assert beat["command"] == ["celery", "-A", "wm.celeryapp", "beat", "--loglevel=INFO"]
    assert beat["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    scheduler = celery_settings(Settings.from_env({}))["beat_scheduler"]
    assert scheduler == "wm.dataplane.beat:DatabaseScheduler"


def test_the_api_is_served_on_loopback_and_checked_through_its_liveness_probe(
    services: dict[str, Any],
) -> None:
    api = services["api"]
    assert api["command"][:2] == ["wm", "api"] and "--insecure" in api["command"]
    assert api["ports"] == ["127.0.0.1:8080:8080"]
    assert "http://127.0.0.1:8080/health/live" in " ".join(api["healthcheck"]["test"])
    assert api["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}


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


def test_flower_is_published_on_5555_behind_basic_authentication(
    services: dict[str, Any], compose_binary: str
) -> None:
    flower = services["flower"]
    assert flower["command"] == ["celery", "-A", "wm.celeryapp", "flower", "--port=5555"]
    assert flower["ports"] == ["127.0.0.1:5555:5555"]
    assert flower["depends_on"]["redis"] == {"condition": "service_healthy"}
    resolved = yaml.safe_load(_config(compose_binary).stdout)["services"]["flower"]
    assert resolved["environment"]["FLOWER_BASIC_AUTH"] == "operator:workmanager"


def test_dockerfile_builds_wheels_in_one_stage_and_installs_them_as_a_non_root_user() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    stages = [i for i, line in enumerate(instructions) if line.startswith("FROM ")]
    assert instructions[stages[0]] == "FROM python:3.11-slim AS build"
    assert instructions[stages[1]] == "FROM python:3.11-slim AS base"
    build, image = instructions[: stages[1]], instructions[stages[1] :]
    extras = "[postgres,flower,native,dotnet,otel,api]"
    assert any("pip wheel" in line and extras in line for line in build)
    # the image gets the wheels through a bind mount: no source, no wheel, no compiler stays
    assert not any(line.startswith("COPY . ") for line in image)
    assert any(line.startswith("RUN --mount=type=bind,from=build") for line in image)
    assert "pip install --no-index --find-links /wheels" in " ".join(image)
    assert extras in " ".join(image)
    assert any("bubblewrap" in line and "libseccomp2" in line for line in image)
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
