"""Fixtures against the real services: PostgreSQL, Redis, RabbitMQ and Celery node processes.

Locally a missing service skips the tests that need it; in CI (``CI`` set) it fails them.

Randomized tests draw from the ``rng`` fixture. Its seed is fresh on every run unless
``TEST_SEED`` is set, and a failing test's report prints it (section "random seed") with the
command line that replays it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

# Imported before any test runs: pytest's hook for unraisable exceptions (an unclosed socket
# collected by gc) imports it lazily, and a collection during that import made the hook fail
# whichever test was running.
import tracemalloc  # noqa: F401
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.helpers import http_server
from wm import Settings, WorkManager, store
from wm.config import current_values
from wm.errors import EmbeddedRedisError
from wm.local.embedded import find_redis_server, start_redis, stop_redis

#: ``celery_app`` and ``celery_worker``: a real Celery worker in a thread of the test process
#: (used with kombu's in-memory broker by test_delivery_policy.py). Celery ships the plugin
#: but no longer registers it; the pytest-celery distribution would, and would also replace
#: ``celery_worker`` with its Docker-based one.
#: ``tests.native.harness``: the native kit's fixtures (libraries, host, wire).
pytest_plugins = (
    "celery.contrib.pytest",
    "tests.native.harness",
    "tests.dotnet.harness",
    "tests.cli_env",
)

PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql+psycopg://root@127.0.0.1:5432/test")
#: pytest-xdist's worker of this process (``gw0``, ``gw1``, …), or none without ``-n``.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")


def _redis_host() -> str:
    """The Redis server of the tests: ``TEST_REDIS_HOST`` (default the local server) for the
    first xdist worker (or a run without ``-n``), and a redis-server of its own, on a free
    port, for each further worker: nothing of a server (pub/sub channels, clients, memory)
    is shared between two workers' tests. The processes a test starts that import this module
    use their worker's server (``_OWN_REDIS_ENV``), not one more of their own, which nobody
    would stop."""
    given = os.environ.get("TEST_REDIS_HOST", "redis://127.0.0.1:6379").rstrip("/")
    if XDIST_WORKER in ("", "gw0"):
        return given
    if os.environ.get(_OWN_REDIS_ENV):
        return os.environ[_OWN_REDIS_ENV]
    data_dir = Path(tempfile.mkdtemp(prefix=f"wm-tests-redis-{XDIST_WORKER}-"))
    server = start_redis(data_dir, persistent=False)
    # stopped by pytest_unconfigure: an xdist worker may leave without running atexit
    _OWN_REDIS.append((server, data_dir))
    atexit.register(_stop_own_redis)
    os.environ[_OWN_REDIS_ENV] = f"redis://127.0.0.1:{server.port}"
    return os.environ[_OWN_REDIS_ENV]


#: The Redis server an xdist worker started for itself, for the processes its tests start.
_OWN_REDIS_ENV = "TEST_OWN_REDIS_HOST"


_OWN_REDIS: list[tuple[Any, Path]] = []


def _stop_own_redis() -> None:
    while _OWN_REDIS:
        server, data_dir = _OWN_REDIS.pop()
        stop_redis(server)
        shutil.rmtree(data_dir, ignore_errors=True)


REDIS_HOST = _redis_host()
AMQP_URL = os.environ.get("TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
#: First of the four Redis databases a test run uses (``TEST_REDIS_DB_BASE``, default 10):
#: two test runs at once on one Redis server need different bases (0-12, not 0-1 overlapping
#: the defaults of WM_BROKER_URL and WM_REDIS_URL).
REDIS_DB_BASE = int(os.environ.get("TEST_REDIS_DB_BASE", "10"))
#: Redis databases of the CLI tests (base, base + 1) and of the others: broker and state.
CLI_BROKER_DB, CLI_STATE_DB = REDIS_DB_BASE, REDIS_DB_BASE + 1
BROKER_DB, STATE_DB = REDIS_DB_BASE + 2, REDIS_DB_BASE + 3
ROOT = Path(__file__).resolve().parent.parent
#: Replays a randomized test: the seed its failure report printed. Not WM_*: the settings
#: refuse unknown WM_* variables, and the suite runs ``Settings.from_env()`` in-process.
SEED_ENV = "TEST_SEED"
_SEED = pytest.StashKey[int]()


#: The terminal's size as the tests' commands see it: xdist's workers start with COLUMNS=80
#: and LINES=24 set, where a run in one process has what the developer's shell has.
TERMINAL = ("COLUMNS", "LINES")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(xdist, in the controller) Hand each worker the controller's terminal variables."""
    node.workerinput["terminal"] = {name: os.environ.get(name) for name in TERMINAL}


def pytest_unconfigure(config: pytest.Config) -> None:
    _stop_own_redis()


def pytest_configure(config: pytest.Config) -> None:
    """(in an xdist worker) Take the controller's terminal variables over xdist's own."""
    given = getattr(config, "workerinput", {}).get("terminal")
    for name, value in (given or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _machine_share(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``alone`` (one that times how the product shares the machine) runs
    while no other xdist worker runs a test; the others share it. Two ``flock`` files: an
    ``alone`` test holds the gate while it waits, so the other worker's next test waits at the
    gate instead of keeping the machine from it."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: nothing runs beside it
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    base = Path(tempfile.gettempdir()) / f"wm-tests-{run}"
    # closing a file releases its lock
    with open(f"{base}.gate", "a") as gate, open(f"{base}.share", "a") as share:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(share, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With xdist (``--dist loadgroup``), every test on RabbitMQ runs in one worker, one after
    another: the tests' deployments differ on Redis by database number, but on the one vhost
    some names (plain subscriptions, the bench's queues) would meet."""
    for item in items:
        spec = getattr(item, "callspec", None)
        on_amqp = spec is not None and any(
            v == "amqp" for v in spec.params.values() if isinstance(v, str)
        )
        if on_amqp or "amqp_settings" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("rabbitmq"))


def need(service: str, error: Exception) -> None:
    message = f"{service} is not available: {error}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def flush_redis(*dbs: int) -> None:
    for db in dbs:
        redis.Redis.from_url(f"{REDIS_HOST}/{db}").flushdb()


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """This test's random seed: ``TEST_SEED`` if set, else a fresh one (printed on failure)."""
    raw = os.environ.get(SEED_ENV, "").strip()
    try:
        value = int(raw) if raw else random.SystemRandom().randrange(2**32)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV}={raw!r} is not an integer") from None
    request.node.stash[_SEED] = value
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture
def rng(seed: int) -> Iterator[random.Random]:
    """A ``random.Random`` seeded with ``seed``. The module-level ``random`` that code under
    test draws from in this process (retry jitter) is seeded too, and restored afterwards."""
    state = random.getstate()
    random.seed(seed)
    yield random.Random(seed)
    random.setstate(state)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    seed = item.stash.get(_SEED, None)
    if seed is not None and report.failed:
        report.sections.append(("random seed", f"seed={seed} (rerun with {SEED_ENV}={seed})"))
    return report


#: ``record_property(FIGURE, text)``: a measured figure a test states (a failover's pause,
#: what was lost); the run's summary lists them, from pytest-xdist's workers too.
FIGURE = "figure"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    figures = [
        f"{report.nodeid}: {value}"
        for report in terminalreporter.stats.get("passed", [])
        for key, value in getattr(report, "user_properties", ())
        if key == FIGURE
    ]
    if figures:
        terminalreporter.section("figures measured by the tests")
        for line in figures:
            terminalreporter.write_line(line)


def pytest_report_header(config: pytest.Config) -> str | None:
    raw = os.environ.get(SEED_ENV)
    return f"random seed fixed by {SEED_ENV}={raw}" if raw else None


@pytest.fixture(scope="session")
def redis_ok() -> None:
    try:
        redis.Redis.from_url(f"{REDIS_HOST}/0", socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        need("Redis", exc)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A throwaway PostgreSQL database for the whole session, dropped afterwards."""
    import sqlalchemy as sa

    name = f"wm_test_{uuid.uuid4().hex[:10]}"
    try:
        admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as exc:
        need("PostgreSQL", exc)
    url = sa.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    yield url
    store.dispose_engines()
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def make_settings(database_url: str, **overrides: Any) -> Settings:
    base = Settings.from_env({}).replace(
        database_url=database_url,
        broker_url=f"{REDIS_HOST}/{BROKER_DB}",
        redis_url=f"{REDIS_HOST}/{STATE_DB}",
    )
    return base.replace(**overrides) if overrides else base


def env_of(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment that makes a subprocess (CLI, Celery node) use ``settings``: every
    setting's variable is set, so none comes from the developer's environment and a setting
    added later reaches the subprocess too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_")}
    env.update(current_values(settings))
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.fixture(params=["sqlite", "postgres"])
def settings(request: pytest.FixtureRequest, tmp_path: Path, redis_ok: None) -> Iterator[Settings]:
    """Settings on a fresh, migrated database of each kind, with clean Redis databases."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'wm.db'}"
    else:
        url = fresh_schema(request.getfixturevalue("pg_url"))
    flush_redis(BROKER_DB, STATE_DB)
    result = make_settings(url)
    store.upgrade(result)
    yield result
    store.dispose_engines()


@pytest.fixture
def pg_settings(pg_url: str, redis_ok: None) -> Iterator[Settings]:
    flush_redis(BROKER_DB, STATE_DB)
    result = make_settings(fresh_schema(pg_url))
    store.upgrade(result)
    yield result
    store.dispose_engines()


def fresh_schema(pg_url: str) -> str:
    """Empty the session database so each test starts from no tables."""
    import sqlalchemy as sa

    store.dispose_engines()
    engine = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text("DROP SCHEMA public CASCADE"))
        conn.execute(sa.text("CREATE SCHEMA public"))
    engine.dispose()
    return pg_url


@pytest.fixture
def manager(settings: Settings) -> WorkManager:
    return WorkManager(settings)


def node_hostname(name: str) -> str:
    """A test node's Celery name, ``name@<host>.<token>``: tests one after another on one
    RabbitMQ vhost start nodes of the same names, and a node's mailbox queue is exclusive to
    its connection, which a loaded broker may not have dropped yet for the node of the same
    name the test before stopped."""
    return f"{name}@{socket.gethostname()}.{uuid.uuid4().hex[:6]}"


class Node:
    """A real ``celery worker`` process."""

    def __init__(
        self,
        settings: Settings,
        name: str,
        log: Path,
        concurrency: int = 2,
        pool: str = "prefork",
        ready: bool = True,
        hostname: str = "",
        **env: str,
    ) -> None:
        """``ready=False``: return once the process runs, without waiting for its start.
        ``hostname``: the node's Celery name (default: :func:`node_hostname` of ``name``)."""
        self.settings, self.name, self.log = settings, name, log
        self.hostname = hostname or node_hostname(name)
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "wm.celeryapp",
            "worker",
            "-n",
            self.hostname,
            "-c",
            str(concurrency),
            "-P",
            pool,
            "--loglevel=INFO",
            "--without-gossip",
            "--without-mingle",
        ]
        self._out = log.open("ab")
        self._asked = False
        self.proc = subprocess.Popen(
            cmd,
            env=env_of(settings, **env),
            cwd=ROOT,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if ready:
            self.wait_for("ready.")

    def wait_for(self, text: str, timeout_s: float = 60, after: int = 0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.log.read_text(errors="replace")[after:]:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"node {self.name} exited:\n{self.tail()}")
            time.sleep(0.1)
        raise AssertionError(f"node {self.name} never logged {text!r}:\n{self.tail()}")

    def consuming(self, queue: str, timeout_s: float = 30) -> None:
        self.wait_for(f"Started consuming from {queue}", timeout_s)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole node (main process and pool children)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=30)

    def ask_to_stop(self) -> None:
        """SIGTERM (a warm shutdown) once, without waiting: nodes stop side by side (each
        takes a second or more: billiard's pool processes sleep 1 s as they exit)."""
        if self.proc.poll() is None and not self._asked:
            self._asked = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.ask_to_stop()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._out.close()


@pytest.fixture
def start_node(tmp_path: Path) -> Iterator[Any]:
    nodes: list[Node] = []

    def start(settings: Settings, name: str = "node1", **kwargs: Any) -> Node:
        node = Node(settings, name, tmp_path / f"{name}-{len(nodes)}.log", **kwargs)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.ask_to_stop()
    for node in nodes:
        node.stop()


@pytest.fixture
def amqp_settings(pg_settings: Settings) -> Settings:
    """``pg_settings`` on the RabbitMQ of ``AMQP_URL``; a missing server fails in CI."""
    from kombu import Connection

    try:
        with Connection(AMQP_URL, connect_timeout=3) as conn:
            conn.connect()
    except OSError as exc:
        need("RabbitMQ", exc)
    return pg_settings.replace(broker_url=AMQP_URL, reconcile_interval_s=1.0)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[int, Callable[[], None]]]:
    """A Redis server of this test's own, which the test may restart on the same port.

    ``start_redis`` (the embedded Redis of ``wm up``) picks a free port at run time and picks
    again if another program takes it before the server binds it; the append-only file in
    its data directory keeps the queued messages across the restart.
    """
    try:
        binary = find_redis_server()
    except EmbeddedRedisError as exc:
        need("redis-server", exc)
    data_dir = tmp_path / "redis"
    servers = [start_redis(data_dir, executable=binary)]
    port = servers[0].port

    def restart() -> None:
        stop_redis(servers[-1])
        time.sleep(2.0)  # an outage the node must ride out, not a wait for a condition
        servers.append(start_redis(data_dir, port=port, executable=binary))

    yield port, restart
    stop_redis(servers[-1])


@pytest.fixture
def gateway_port() -> Iterator[int]:
    """A loopback gateway that echoes what it gets (``tests.helpers.echo``)."""
    with http_server() as gateway:
        yield gateway.port


@pytest.fixture(scope="session")
def native_zips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The example native workers, built by ``make -C native_abi``: name -> worker zip."""
    build = tmp_path_factory.mktemp("native-build")
    result = subprocess.run(
        [
            "make",
            "-s",
            "-C",
            str(ROOT / "native_abi"),
            f"BUILD={build}",
            f"PYTHON={sys.executable}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"make -C native_abi failed:\n{result.stdout}{result.stderr}"
    return {zip_file.stem: zip_file for zip_file in build.glob("*.zip")}
