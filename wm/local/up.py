"""``wm up``: a complete single-machine WorkManager in the foreground.

A real Redis server (the packaged binary of the ``embedded`` extra, or the system's), SQLite,
migrations applied, and a Celery node consuming; Ctrl-C stops everything cleanly. With
``--demo`` it also creates a Python worker and shows events flowing through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TextIO

from celery import Celery
from celery.utils.nodenames import host_format

from wm import stopsignals, store
from wm.config import FILE_SUFFIX, FROM_FILE, Settings, given, masked
from wm.dataplane.app import broker_connection, broker_errors, make_app
from wm.dataplane.queues import DEFAULT_QUEUE
from wm.errors import ConfigurationError, NodeUnavailable
from wm.events import make_event
from wm.local.embedded import EmbeddedRedis, free_port, start_redis, stop_redis
from wm.manager import WorkManager
from wm.store.db import absolute_sqlite
from wm.views import WorkerInfo

#: Where ``wm up`` keeps its database, Redis files and logs (relative to the working dir).
HOME = Path(".wm")
#: Seconds a starting node has to answer a ping.
NODE_START_TIMEOUT_S = 60.0
#: Seconds a stopping node has to finish its tasks before it is killed.
NODE_STOP_TIMEOUT_S = 30.0
#: Seconds what outlives a stopped node in its process group has before it is killed.
GROUP_END_S = 5.0
#: The node's name (``%h``: this host's name, as Celery expands it).
NODE_NAME = "wm-up@%h"
#: The variables of the system ``wm up`` runs: written to ``.wm/env`` once it is up.
DATABASE, BROKER, REDIS = "WM_DATABASE_URL", "WM_BROKER_URL", "WM_REDIS_URL"
#: The first node's health and metrics port (``wm health``), also written to ``.wm/env``.
HEALTH_PORT = "WM_HEALTH_PORT"
#: Longest reason quoted from an unreachable service's error, in characters.
REASON_CHARS = 200
DEMO_TOPIC = "demo.orders"
DEMO_OUTPUT = "demo.shouted"
DEMO_CODE = '''\
from wm.devkit import WorkerBase


class Shout(WorkerBase):
    """The demo worker: shouts the text it is given."""

    def __init__(self):
        super().__init__("demo.shouted", "/demo/shout")

    def process(self, event):
        return self.response(event, {"text": event.get_data()["text"].upper() + "!"})
'''


def run(
    demo: bool = False,
    events: int = 0,
    concurrency: int = 2,
    pool: str = "prefork",
    as_json: bool = False,
    nodes: int = 0,
) -> int:
    """Run until Ctrl-C (or until ``events`` demo events went through); returns an exit code.

    ``nodes`` Celery nodes of ``concurrency`` processes run (0: :func:`default_nodes`).

    With ``as_json`` the messages for people go to standard error and standard output gets
    one JSON object once the system is up (:func:`_announce`), for a script that starts it.
    """
    home = HOME.resolve()
    home.mkdir(parents=True, exist_ok=True)
    global _stopping
    _stopping = False
    stdout = sys.stdout
    people = contextlib.redirect_stdout(sys.stderr if as_json else stdout)
    with stopsignals.handled(_interrupt), people:  # SIGHUP too: nodes outlive a terminal
        if given(DATABASE):
            check_reachable(Settings.from_env(), [DATABASE])
        with embedded_redis(home) as settings:
            # the first node serves /health and /metrics here (`wm health` reads .wm/env)
            settings = settings.replace(health_port=settings.health_port or free_port())
            store.upgrade(settings)
            _say(f"database   {masked(settings.database_url)} (migrated)")
            with celery_nodes(home, settings, nodes, concurrency, pool) as node:
                try:
                    env_file = _up(home, settings)
                    if as_json:
                        _announce(stdout, env_file, settings, node)
                    _serve(settings, demo, events)
                except KeyboardInterrupt:  # Ctrl-C (SIGTERM, SIGHUP) once up: stop everything
                    _say("stopping   …")
        _say("stopped")
    return 0


def _up(home: Path, settings: Settings) -> Path:
    """Once the system is up: ``.wm/env`` written, and where its shell and health are said.

    Written only now: a file naming a system that never came up would send the next
    ``set -a; . .wm/env`` (and ``wm up``) to services that are not there."""
    env_file = _write_env(home, settings)
    _say(f"shell      `set -a; . {env_file}; set +a` points `wm` at this system")
    _say(
        f"health     http://{settings.health_bind}:{settings.health_port}/health "
        "and /metrics of the first node (`wm health`)"
    )
    return env_file


def default_nodes(concurrency: int, pool: str, cores: int | None = None) -> int:
    """One prefork node per ``concurrency`` cores (at least one), one node of another pool.

    A node's main process takes, decodes and acknowledges every message and hands each to
    a pool process, one at a time: it caps a node at about 1,000 events/s whatever its
    process count, so a machine's cores are used by several small nodes, not one big one.
    """
    if pool != "prefork":
        return 1
    return max(1, (cores or os.cpu_count() or 1) // concurrency)


@contextlib.contextmanager
def celery_nodes(
    home: Path, settings: Settings, count: int, concurrency: int, pool: str
) -> Iterator[subprocess.Popen[bytes]]:
    """``count`` nodes (0: :func:`default_nodes`) of ``wm up``, the first running beat;
    yields the first once every one answers a ping."""
    count = count or default_nodes(concurrency, pool)
    names = [NODE_NAME] + [NODE_NAME.replace("@", f"-{n}@") for n in range(2, count + 1)]
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(celery_node(home, settings, concurrency, pool=pool, beat=True))
        for n, name in enumerate(names[1:], start=2):
            stack.enter_context(
                celery_node(
                    home,
                    settings.replace(health_port=0),  # one endpoint: the first node's
                    concurrency,
                    pool=pool,
                    name=name,
                    log_name=f"node-{n}.log",
                )
            )
        if count > 1:
            _wait_for_all(settings, [host_format(name) for name in names])
            _say(f"cores      {count} nodes of {concurrency} {_unit(pool)} each (--nodes)")
        yield first


def _wait_for_all(settings: Settings, names: list[str]) -> None:
    app, answered = make_app(settings), set()
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        with broker_errors(settings):
            for reply in app.control.ping(destination=names, timeout=1.0) or []:
                answered.update(reply)
        if answered >= set(names):
            return
    missing = ", ".join(sorted(set(names) - answered))
    raise NodeUnavailable(f"nodes {missing} did not answer within {NODE_START_TIMEOUT_S}s")


def _unit(pool: str) -> str:
    return "processes" if pool == "prefork" else pool


def _serve(settings: Settings, demo: bool, events: int) -> None:
    """The foreground part: the demo, or a wait for Ctrl-C (SIGTERM acts the same)."""
    if demo:
        _demo(settings, events)
    else:
        _say("ready      Ctrl-C stops everything")
        while not _stopping:  # a stop whose KeyboardInterrupt a finalizer swallowed
            time.sleep(1.0)
        raise KeyboardInterrupt


def _announce(
    stream: TextIO, env_file: Path, settings: Settings, node: subprocess.Popen[bytes]
) -> None:
    """The ``--json`` answer: what ``.wm/env`` holds (passwords masked) and the node."""
    variables = {name: masked(value) for name, value in _env_values(settings).items()}
    answer = {
        "env_file": str(env_file),
        "env": variables,
        "node": {"name": host_format(NODE_NAME), "pid": node.pid},
    }
    print(json.dumps(answer), file=stream, flush=True)


@contextlib.contextmanager
def embedded_redis(home: Path) -> Iterator[Settings]:
    """Settings for this system; starts the embedded Redis unless WM_*_URL name a broker.

    A broker or Redis named in the environment is used only if it answers: a value left by
    an earlier ``wm up`` (``set -a; . .wm/env``) names an embedded Redis that is gone.
    """
    settings = Settings.from_env()
    settings = settings.replace(database_url=absolute_sqlite(settings.database_url))
    if given(BROKER) or given(REDIS):
        check_reachable(settings, [BROKER, REDIS])
        _say(f"broker     {masked(settings.broker_url)} (from the environment)")
        yield settings
        return
    server: EmbeddedRedis = start_redis(home / "redis")
    _say(f"redis      {server.url} (embedded, pid {server.pid}, data in {server.data_dir})")
    try:
        yield settings.replace(broker_url=f"{server.url}/0", redis_url=f"{server.url}/1")
    finally:
        stop_redis(server)


def check_reachable(settings: Settings, variables: Iterable[str]) -> None:
    """Raise :class:`ConfigurationError` naming the first of ``variables`` (WM_BROKER_URL,
    WM_REDIS_URL, WM_DATABASE_URL) whose service does not answer (``wm.ops.health``'s
    checks, each bounded by its timeout)."""
    from wm.ops.health import CHECKS

    checks = dict(CHECKS.values())
    for variable in variables:
        try:
            checks[variable](settings)
        except Exception as exc:  # any failure to answer is the finding, as in wm health
            raise ConfigurationError(_unreachable(settings, variable, exc)) from exc


def _unreachable(settings: Settings, variable: str, exc: Exception) -> str:
    """One line: the variable, its URL (password masked), the reason, what to do."""
    url = masked(getattr(settings, variable[3:].lower()))
    lines = str(exc).strip().splitlines()
    reason = " ".join(lines[0].split())[:REASON_CHARS] if lines else type(exc).__name__
    if given(variable):
        return (
            f"{variable}={url} is unreachable ({reason}); unset it to let wm up start its "
            "own, or start that service"
        )
    other = BROKER if variable == REDIS else REDIS
    return (
        f"{variable}={url} (its default) is unreachable ({reason}); set it, unset {other} "
        "to let wm up start its own, or start that service"
    )


def _env_values(settings: Settings) -> dict[str, str]:
    return {
        DATABASE: settings.database_url,
        BROKER: settings.broker_url,
        REDIS: settings.redis_url,
        HEALTH_PORT: str(settings.health_port),
    }


def _write_env(home: Path, settings: Settings) -> Path:
    """Replace ``.wm/env`` in one step, so a shell sourcing it never reads half a file;
    readable by its owner only (the URLs may hold passwords), values quoted for the shell."""
    path = home / "env"
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    text = "".join(f"{k}={shlex.quote(v)}\n" for k, v in _env_values(settings).items())
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
        out.write(text)
    partial.replace(path)
    return path


def _child_env(settings: Settings) -> dict[str, str]:
    """The node's environment: this one, with the system's URLs in place of any given here
    (a URL's ``*_FILE`` form too, which the node would refuse beside the URL)."""
    env = {k: v for k, v in os.environ.items() if k not in {n + FILE_SUFFIX for n in FROM_FILE}}
    env.update(
        WM_DATABASE_URL=settings.database_url,
        WM_BROKER_URL=settings.broker_url,
        WM_REDIS_URL=settings.redis_url,
        WM_TASK_EVENTS=str(settings.task_events).lower(),
        WM_READY_LIST=str(settings.ready_list).lower(),
        WM_HEALTH_PORT=str(settings.health_port),
    )
    return env


@contextlib.contextmanager
def celery_node(
    home: Path,
    settings: Settings,
    concurrency: int,
    queues: Sequence[str] = (DEFAULT_QUEUE,),
    *,
    app_module: str = "wm.celeryapp",
    name: str = NODE_NAME,
    control: Celery | None = None,
    pool: str = "prefork",
    beat: bool = False,
    log_name: str = "node.log",
) -> Iterator[subprocess.Popen[bytes]]:
    """A Celery node as a child process in its own session; stopped with a warm shutdown.

    ``control`` is the app whose pings tell that the node is up (default: one built from
    ``settings``); a node of ``app_module`` with its own control exchange needs its own.
    ``pool`` is Celery's execution pool (``-P``) and ``concurrency`` its size. ``beat``
    also runs Celery beat in the node (``-B``), which fires the workers' schedules.
    """
    log_path = home / log_name
    command = _node_command(app_module, name, pool, concurrency, queues, beat)
    with log_path.open("ab") as log:
        node = subprocess.Popen(
            command,
            env=_child_env(settings),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _nodes.add(node.pid)
    try:
        _wait_for_node(control or make_app(settings), settings, node, log_path)
        _say(f"node       celery pid {node.pid}, {concurrency} {_unit(pool)}, log {log_path}")
        if beat:
            _say("beat       in the node: fires the workers' schedules (wm schedule)")
        yield node
    finally:
        _stop_node(node)


def _node_command(
    app_module: str, name: str, pool: str, concurrency: int, queues: Sequence[str], beat: bool
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        app_module,
        "worker",
        "-n",
        name,
        "-P",
        pool,
        "-c",
        str(concurrency),
        "--loglevel=INFO",
        "-Q",
        ",".join(queues),
        *(["-B"] if beat else []),
    ]


def _wait_for_node(
    app: Celery, settings: Settings, node: subprocess.Popen[bytes], log_path: Path
) -> None:
    """Return once the node answers a ping; one line if it exits, is silent, or the broker
    goes away meanwhile."""
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if node.poll() is not None:
            raise NodeUnavailable(
                f"the Celery node exited with {node.returncode} before it answered "
                f"({_last_line(log_path)}); its log: {log_path}"
            )
        with broker_errors(settings):
            if app.control.ping(timeout=1.0):
                return
    raise NodeUnavailable(
        f"the Celery node did not answer within {NODE_START_TIMEOUT_S}s; its log: {log_path}"
    )


def _last_line(log_path: Path) -> str:
    """The log's last line that says something (a traceback ends with the error)."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines()]
    said = [line for line in lines if line]
    return said[-1][:REASON_CHARS] if said else "its log is empty"


def _stop_node(node: subprocess.Popen[bytes]) -> None:
    """A warm shutdown: SIGTERM to the node's main process, which lets its deliveries
    finish and stops its pool processes and beat itself (SIGTERM to its whole group would
    end each pool process's delivery where it stands); its group is killed if it has not
    ended after :data:`NODE_STOP_TIMEOUT_S`, or at a stop signal meanwhile. Whatever of
    its group outlives it (a beat that has not seen its SIGTERM yet) is ended then."""
    global _stopping
    _stopping = True  # however the stop began: a signal now kills, never cuts it short
    if node.poll() is None:
        os.kill(node.pid, signal.SIGTERM)
        try:
            node.wait(timeout=NODE_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    _end_group(node.pid)
    _nodes.discard(node.pid)


def _end_group(group: int) -> None:
    """End what is left of a stopped node's process group: SIGTERM, then SIGKILL past
    :data:`GROUP_END_S` (and no more waiting past twice that: a zombie nobody reaps
    still counts as a member)."""
    started = time.monotonic()
    while time.monotonic() - started < 2 * GROUP_END_S:
        late = time.monotonic() - started > GROUP_END_S
        try:
            os.killpg(group, signal.SIGKILL if late else signal.SIGTERM)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def _demo(settings: Settings, events: int) -> None:
    """Create the demo worker and push an event a second through it, printing both ends."""
    manager = WorkManager(settings)
    queue = manager.subscribe(DEMO_OUTPUT, "wm-up-demo")
    worker = _demo_worker(manager)
    _say(f"demo       worker {worker.id} (text/x-python) on topic {DEMO_TOPIC} → {DEMO_OUTPUT}")
    sent = 0
    with broker_errors(settings), broker_connection(settings) as conn:
        outputs = conn.SimpleQueue(queue)
        try:
            while (not events or sent < events) and not _stopping:
                sent += 1
                event = make_event(
                    DEMO_TOPIC,
                    "/demo",
                    {"text": f"hello number {sent}"},
                    extensions={"correlationid": f"demo-{sent}"},
                )
                manager.publish(event)
                _say(f"→ {DEMO_TOPIC:<13} {event.get_data()!r}")
                _show_output(outputs)
        finally:
            outputs.close()


def _demo_worker(manager: WorkManager) -> WorkerInfo:
    for worker in manager.list_workers(topic=DEMO_TOPIC):
        if worker.name == "demo-shout":
            return worker
    return manager.create_worker(
        code=DEMO_CODE, mime_type="text/x-python", topic=DEMO_TOPIC, name="demo-shout"
    )


def _show_output(outputs: object) -> None:
    message = outputs.get(timeout=30)  # type: ignore[attr-defined]
    event = json.loads(message.body)
    _say(f"← {event['type']:<13} {event['data']} correlationid={event.get('correlationid')}")
    message.ack()
    time.sleep(1.0)


#: The process groups of the nodes running now (:func:`celery_node`).
_nodes: set[int] = set()
#: Whether a stop signal came (:func:`_interrupt`).
_stopping = False


def _interrupt(signum: int, frame: object) -> None:
    """The first stop signal stops everything, each node given its time to finish; another
    while that runs kills the nodes at once rather than cut the stop short, which would
    leave them (and Redis) running."""
    global _stopping
    if not _stopping:
        _stopping = True
        raise KeyboardInterrupt
    for group in list(_nodes):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def _say(text: str) -> None:
    print(f"wm up  {text}", flush=True)
