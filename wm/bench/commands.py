"""The read-command phase of ``wm bench``: how long every command that only reads takes
against a store of realistic size.

It builds a store of its own -- ``workers`` workers (stub engine), each with several code
versions and state changes, schedules, plain subscriptions with waiting messages, dead
letters, tokens and audit entries -- in a database made for the phase (on the PostgreSQL
server ``--commands-database-url`` names, dropped at the end) or, without one, in SQLite.
Then each read command runs as a new process, the way a person runs it, ``repeats`` times
(after one unmeasured run that warms the file cache); the table gives each one's median and
worst wall-clock time against :data:`TARGET_S` (:data:`HELP_TARGET_S` for ``wm --help``),
and its CPU time, with one Celery node running (the one ``wm status`` finds) and no traffic.
Then each runs again with ``WM_API_URL`` naming a ``wm api`` the phase starts on the same
store (an admin token in ``WM_API_TOKEN``): the commands the API serves ask it
(``wm.cli.remote``), the others read the store themselves as before.
The load average is printed with them: on a busy machine the wall clock waits for a core.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

from wm import store
from wm.config import Settings, current_values
from wm.control.access import Tokens
from wm.events import make_event
from wm.local.embedded import LOOPBACK, free_port
from wm.local.up import celery_node
from wm.manager import WorkManager
from wm.store import access
from wm.store.models import DeadLetter, WorkerTransition

#: The targets of issue 29, in seconds: any read command, and ``wm --help``.
TARGET_S = 0.5
HELP_TARGET_S = 0.1
#: Seconds ``wm api`` has to answer before the phase gives up.
API_START_S = 60.0
#: The stub engine's MIME type: workers that need no runtime.
STUB = "application/x-wm-stub"
#: Of each worker: code versions, dead letters; of the store: subscriptions, tokens, audit
#: entries; every how many workers one has a schedule, and one is stopped.
VERSIONS = 3
LETTERS_PER_WORKER = 4
SUBSCRIPTIONS = 20
TOKENS = 20
AUDIT_ENTRIES = 500
SCHEDULE_EVERY = 3
STOPPED_EVERY = 5
#: Seed of the store's random choices (topics, errors), printed with the table.
SEED = 29


@dataclass(frozen=True)
class Timing:
    command: str
    median_s: float
    max_s: float
    target_s: float
    #: The process's own CPU time (user and system), median: what the wall clock comes down
    #: to on an idle machine, less its waits for the database, Redis and the broker.
    cpu_s: float
    #: The median with ``WM_API_URL`` set (and its worst).
    api_median_s: float
    api_max_s: float

    def to_json(self) -> dict[str, object]:
        return {
            "command": self.command,
            "median_s": round(self.median_s, 4),
            "max_s": round(self.max_s, 4),
            "target_s": self.target_s,
            "cpu_s": round(self.cpu_s, 4),
            "api_median_s": round(self.api_median_s, 4),
            "api_max_s": round(self.api_max_s, 4),
        }


@dataclass(frozen=True)
class Store:
    """What the phase built, and the references its commands name."""

    workers: int
    versions: int
    transitions: int
    dead_letters: int
    schedules: int
    subscriptions: int
    tokens: int
    audit_entries: int
    worker: str
    letter: str
    topic: str
    subscription: str

    def describe(self) -> str:
        return (
            f"{self.workers} workers, {self.versions} versions, {self.transitions} transitions, "
            f"{self.dead_letters} dead letters, {self.schedules} schedules, "
            f"{self.subscriptions} plain subscriptions, {self.tokens} tokens, "
            f"{self.audit_entries} audit entries"
        )


def read_commands(built: Store) -> list[list[str]]:
    """Every ``wm`` command that only reads, with the arguments it needs in ``built``."""
    worker = built.worker
    return [
        ["--help"],
        ["--version"],
        ["status"],
        ["worker", "list"],
        ["worker", "show", worker],
        ["worker", "history", worker],
        ["worker", "transitions", worker],
        ["worker", "code", worker],
        ["session", "show", worker, "s1"],
        ["schedule", "list"],
        ["subscriptions"],
        ["consume", built.topic, "--name", built.subscription, "--peek"],
        ["dlq", "list"],
        ["dlq", "show", built.letter],
        ["tenant", "list"],
        ["token", "list"],
        ["audit"],
        ["db", "current"],
        ["config"],
    ]


@contextlib.contextmanager
def database(server_url: str | None, scratch: str) -> Iterator[str]:
    """A new, empty database: on the PostgreSQL server ``server_url`` names (dropped
    afterwards), or a SQLite file in ``scratch``."""
    if server_url is None:
        yield f"sqlite:///{scratch}/commands.db"
        return
    name = f"wm_bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        yield sa.make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        store.dispose_engines()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def build(settings: Settings, workers: int, seed: int = SEED) -> Store:
    """Fill the (migrated) store of ``settings``; see the module's docs."""
    rng = random.Random(seed)
    manager = WorkManager(settings)
    ids = [_worker(manager, n, rng) for n in range(workers)]
    for n, wid in enumerate(ids):
        if n % SCHEDULE_EVERY == 0:
            manager.add_schedule(wid, event_type=f"tick.{n}", every_s=60 + n)
    topic = "bench.inbox"
    for n in range(SUBSCRIPTIONS):
        manager.subscribe(f"{topic}.{n}" if n else topic, f"inbox{n}")
    for n in range(SUBSCRIPTIONS):
        manager.publish(make_event(topic, "/bench", {"n": n}))
    letters = _dead_letters(settings, ids, rng)
    for n in range(TOKENS):
        Tokens(settings).create(f"token-{n}", ("viewer", "operator", "admin")[n % 3])
    _audit(settings)
    with store.session_scope(settings) as session:
        transitions = session.scalar(sa.select(sa.func.count()).select_from(WorkerTransition))
    return Store(
        workers=workers,
        versions=workers * VERSIONS,
        transitions=int(transitions or 0),
        dead_letters=len(letters),
        schedules=len(range(0, workers, SCHEDULE_EVERY)),
        subscriptions=SUBSCRIPTIONS,
        tokens=TOKENS,
        audit_entries=AUDIT_ENTRIES,
        worker=f"w{workers // 2:04d}",
        letter=letters[len(letters) // 2],
        topic=topic,
        subscription="inbox0",
    )


def _worker(manager: WorkManager, n: int, rng: random.Random) -> str:
    """One worker with :data:`VERSIONS` versions; every :data:`STOPPED_EVERY`-th stopped."""
    info = manager.create_worker(
        code=b"{}", mime_type=STUB, topic=f"bench.t{rng.randrange(50)}", name=f"w{n:04d}"
    )
    for version in range(2, VERSIONS + 1):
        manager.load_code_from_content(
            info.id, f'{{"sleep_ms": {version}}}'.encode(), note=f"v{version}"
        )
    if n % STOPPED_EVERY == 0:
        manager.stop_worker(info.id)
    return str(info.id)


def _dead_letters(settings: Settings, ids: list[str], rng: random.Random) -> list[str]:
    now = datetime.now(UTC)
    errors = ["WorkerTimeout", "EngineError", "MalformedEvent"]
    rows = [
        DeadLetter(
            id=uuid.UUID(int=rng.getrandbits(128)).hex,
            topic=f"bench.t{n % 50}",
            worker_id=uuid.UUID(wid),
            event_id=str(uuid.UUID(int=rng.getrandbits(128))),
            envelope="{}",
            error_type=rng.choice(errors),
            error_message="failed after retries",
            attempts=4,
            version=1,
            first_failure_at=now - timedelta(minutes=n + 1),
            last_failure_at=now - timedelta(minutes=n),
            replay_count=0,
        )
        for n, wid in enumerate(ids)
        for _ in range(LETTERS_PER_WORKER)
    ]
    with store.session_scope(settings) as session:
        session.add_all(rows)
    return [row.id for row in rows]


def _audit(settings: Settings) -> None:
    now = datetime.now(UTC)
    with store.session_scope(settings) as session:
        for n in range(AUDIT_ENTRIES):
            entry = access.begin_entry(
                session, now - timedelta(seconds=n), "POST", f"/v1/workers/{n}/stop",
                "127.0.0.1", "default",
            )  # fmt: skip
            access.finish_entry(
                session, entry, token=None, action="stop", status_code=200, result="ok",
                duration_ms=3.0,
            )  # fmt: skip


def _time(argv: Sequence[str], env: dict[str, str], repeats: int) -> tuple[float, float, float]:
    """Median and worst wall-clock time of ``argv`` and its median CPU time, after one
    unmeasured run that warms the file cache."""
    subprocess.run(argv, env=env, capture_output=True, check=True)
    took, cpu = [], []
    for _ in range(repeats):
        before = _children_cpu_s()
        began = time.perf_counter()
        subprocess.run(argv, env=env, capture_output=True, check=True)
        took.append(time.perf_counter() - began)
        cpu.append(_children_cpu_s() - before)
    return statistics.median(took), max(took), statistics.median(cpu)


def _children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def measure(settings: Settings, built: Store, repeats: int, api_url: str) -> list[Timing]:
    """Each read command's median and worst time over ``repeats`` new processes, reading
    the store itself and through the API at ``api_url``."""
    env = _env(settings)
    secret = Tokens(settings).create(f"bench-{uuid.uuid4().hex[:8]}", "admin")[1]
    store.dispose_engines()
    through_api = {**env, "WM_API_URL": api_url, "WM_API_TOKEN": secret}
    timings = []
    for args in read_commands(built):
        argv = [sys.executable, "-m", "wm.cli", *args]
        median_s, max_s, cpu_s = _time(argv, env, repeats)
        api_median_s, api_max_s, _ = _time(argv, through_api, repeats)
        target = HELP_TARGET_S if args == ["--help"] else TARGET_S
        timings.append(
            Timing("wm " + " ".join(args), median_s, max_s, target, cpu_s, api_median_s, api_max_s)
        )
    return timings


def _env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_")}
    env.update(current_values(settings))
    return env


@contextlib.contextmanager
def admin_api(settings: Settings, scratch: str) -> Iterator[str]:
    """A ``wm api`` on ``settings`` on a free loopback port, until the block ends; its URL."""
    import urllib.request

    url = f"http://{LOOPBACK}:{free_port()}"
    argv = [sys.executable, "-m", "wm.cli", "api", "--port", url.rpartition(":")[2]]
    with open(Path(scratch) / "api.log", "wb") as log:
        server = subprocess.Popen(argv, env=_env(settings), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + API_START_S
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"wm api ended (exit {server.returncode}); see {log.name}")
            try:
                with urllib.request.urlopen(f"{url}/health/live", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"wm api did not answer in {API_START_S} s") from None
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def report(
    settings: Settings, scratch: str, server_url: str | None, workers: int, repeats: int
) -> dict[str, object]:
    """Build the store, time the commands, print the table; the results for ``--json``."""
    with database(server_url, scratch) as url:
        phase = settings.replace(database_url=url)
        store.upgrade(phase)
        built = build(phase, workers)
        store.dispose_engines()
        with (
            celery_node(Path(scratch), phase, 1, pool="threads"),  # answers wm status' ping
            admin_api(phase, scratch) as api_url,
        ):
            load = os.getloadavg()[0]
            timings = measure(phase, built, repeats, api_url)
            load = max(load, os.getloadavg()[0])
    kind = "PostgreSQL" if server_url else "SQLite"
    _table(timings, kind, built, repeats, load)
    return {
        "database": kind,
        "store": built.describe(),
        "repeats": repeats,
        "load_average": round(load, 2),
        "commands": [t.to_json() for t in timings],
    }


def _table(timings: list[Timing], kind: str, built: Store, repeats: int, load: float) -> None:
    print(f"\nRead commands (median and worst of {repeats} runs, each a new process; {kind})")
    print(f"store: {built.describe()} (seed {SEED}); load average up to {load:.2f}")
    print("direct: the command reads the store itself; API: with WM_API_URL set (wm api)")
    print(
        f"{'command':<46} {'direct s':>9} {'max s':>6} {'cpu s':>6} {'API s':>6} {'max s':>6} "
        f"{'target s':>8}"
    )
    for t in timings:
        over = [
            side for side, s in (("direct", t.median_s), ("API", t.api_median_s)) if s > t.target_s
        ]
        print(
            f"{t.command:<46} {t.median_s:>9.3f} {t.max_s:>6.3f} {t.cpu_s:>6.3f} "
            f"{t.api_median_s:>6.3f} {t.api_max_s:>6.3f} {t.target_s:>8.2f}"
            + (f"  over: {', '.join(over)}" if over else "")
        )
