"""The drain's reference side: ``count`` plain Celery nodes (``wm/bench/plain/plaincelery``),
each its own ``celery worker`` process tree with only that folder on its import path, so
nothing of WorkManager is loaded there (:meth:`PlainNodes.wm_modules` asks them). They run
as the issue measured bare Celery: prefork ``-c N``, log level WARNING, on the bench's
broker, with control and event exchanges named after the bench's prefix.

The bench talks to them through an app of its own (``PlainNodes.app``, configured like
theirs): it fills their queue, pauses and resumes it with ``cancel_consumer`` and
``add_consumer`` broadcasts, and counts their successes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from celery import Celery

from wm.bench.plain import plaincelery
from wm.bench.rig import size_pools

#: The folder ``celery -A plaincelery`` runs from: the only one put on its import path.
PLAIN_DIR = Path(plaincelery.__file__).resolve().parent
#: Seconds the nodes have to answer a ping, and a warm shutdown to end.
UP_TIMEOUT_S, STOP_TIMEOUT_S = 120.0, 30.0
#: Seconds a control command's replies are collected.
CONTROL_TIMEOUT_S = 5.0


class PlainNodes:
    """``count`` plain Celery nodes of ``concurrency`` processes, idle until told to consume
    a queue; leaving stops them (a warm shutdown each)."""

    def __init__(
        self, broker_url: str, prefix: str, home: Path, count: int, concurrency: int
    ) -> None:
        self.broker_url, self.home = broker_url, home
        self.count, self.concurrency = count, concurrency
        self.prefix = f"{prefix}-plain"
        self.names = [f"{self.prefix}@{socket.gethostname()}.{n}" for n in range(count)]
        self.idle = f"{self.prefix}.idle"
        self.app = control_app(broker_url, self.prefix, count)
        self.processes: list[subprocess.Popen[bytes]] = []
        #: Queues the nodes were told to consume: deleted with their exchanges at the end.
        self.queues: list[str] = [self.idle]

    def __enter__(self) -> PlainNodes:
        try:
            for name in self.names:
                self.processes.append(self._launch(name))
            self._wait_up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The nodes' main processes (their pools are under them)."""
        return [process.pid for process in self.processes]

    def _launch(self, name: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "celery", "-A", "plaincelery", "worker"]
        command += ["-n", name, "-P", "prefork", "-c", str(self.concurrency)]
        command += ["--loglevel=WARNING", "-Q", self.idle]
        variables = {plaincelery.BROKER_ENV: self.broker_url, plaincelery.PREFIX_ENV: self.prefix}
        return spawn(command, self.home / f"plain-{name.rpartition('.')[2]}", variables)

    def _wait_up(self) -> None:
        answered: set[str] = set()
        deadline = time.monotonic() + UP_TIMEOUT_S
        while answered < set(self.names):
            for process in self.processes:
                if process.poll() is not None:
                    raise SystemExit(
                        f"wm bench: a plain Celery node exited with {process.returncode}; "
                        f"its log: {self.home}/plain-*/node.log"
                    )
            if time.monotonic() > deadline:
                raise SystemExit(f"wm bench: {self.count} plain Celery nodes did not come up")
            waiting = [name for name in self.names if name not in answered]
            for reply in self.app.control.ping(waiting, timeout=0.5, limit=len(waiting)) or []:
                answered.update(reply)

    def broadcast(self, command: str, **arguments: Any) -> dict[str, Any]:
        """Every node's reply to ``command``; raises unless all answer in time."""
        replies = self.app.control.broadcast(
            command,
            arguments=arguments,
            destination=self.names,
            reply=True,
            timeout=CONTROL_TIMEOUT_S,
            limit=self.count,
        )
        merged = {name: body for reply in replies or [] for name, body in reply.items()}
        missing = set(self.names) - set(merged)
        if missing:
            raise RuntimeError(f"plain Celery nodes {sorted(missing)} did not answer {command!r}")
        return merged

    def pause(self, queue: str) -> None:
        self.broadcast("cancel_consumer", queue=queue)

    def resume(self, queue: str) -> None:
        if queue not in self.queues:
            self.queues.append(queue)
        self.broadcast("add_consumer", queue=queue, exchange=queue, routing_key=queue)

    def succeeded(self) -> int:
        """Tasks the nodes finished with success since they started."""
        return sum(int(body["succeeded"]) for body in self.broadcast("plain_succeeded").values())

    def wm_modules(self) -> list[str]:
        """Modules of WorkManager's loaded by any node (none, or the reference is not one)."""
        replies = self.broadcast("plain_wm_modules").values()
        return sorted({name for body in replies for name in body["modules"]})

    def fill(self, queue: str, count: int) -> None:
        """``count`` tasks of the reference to ``queue``."""
        with self.app.producer_or_acquire() as producer:
            for _ in range(count):
                self.app.send_task(plaincelery.NOOP, queue=queue, producer=producer)

    def describe(self) -> str:
        """How the nodes run (the first one's ``stats``), and that they load nothing of wm."""
        stats = self.broadcast("stats")[self.names[0]]
        conf = self.broadcast("conf", with_defaults=True)[self.names[0]]
        pool, loaded = stats["pool"], self.wm_modules()
        if loaded:
            raise SystemExit(f"wm bench: the plain Celery reference loaded {loaded}")
        return (
            f"plain celery {', '.join(self.names)}: {pool['implementation']}, "
            f"{pool['max-concurrency']} processes, prefetch {stats['prefetch_count']} "
            f"(multiplier {conf.get('worker_prefetch_multiplier')}), acks late "
            f"{conf.get('task_acks_late')}, serializer {conf.get('task_serializer')}, log level "
            "WARNING, no module of wm loaded"
        )

    def close(self) -> None:
        """A warm shutdown of every node at once, then a kill for any that lingers."""
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.processes = []
        try:
            self._delete_names()
        finally:
            self.app.close()

    def _delete_names(self) -> None:
        """The queues and exchanges the nodes declared (a RabbitMQ vhost keeps them)."""
        pidbox = f"{self.prefix}.pidbox"
        exchanges = [pidbox, f"reply.{pidbox}", f"{self.prefix}.events", *self.queues]
        with self.app.connection_for_write() as connection:
            channel = connection.default_channel
            for queue in self.queues:
                channel.queue_delete(queue)
            for exchange in exchanges:
                channel.exchange_delete(exchange)


def spawn(command: list[str], home: Path, variables: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """A reference node: ``command`` run in ``home`` (made if missing), in a session of its
    own, with this environment less WorkManager's and Python's variables, only
    :data:`PLAIN_DIR` on its import path, and ``variables``; its output to ``node.log``."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WM_", "PYTHON"))}
    env.update(PYTHONPATH=str(PLAIN_DIR), **variables)
    with (home / "node.log").open("ab") as log:
        return subprocess.Popen(
            command, cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def control_app(broker_url: str, prefix: str, nodes: int) -> Celery:
    """The bench's side of the plain nodes: their broker, exchanges and serializer, with
    pools sized for ``nodes`` (Celery's default of 10 deadlocks many nodes' start-up)."""
    app = Celery(f"{prefix}-control", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        task_serializer="json",
        accept_content=["json"],
        result_backend=None,
        task_ignore_result=True,
        control_exchange=prefix,
        event_exchange=f"{prefix}.events",
    )
    size_pools(app, nodes)
    return app
