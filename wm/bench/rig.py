"""What the phases of ``wm bench`` share: names of their own, a node of their own, the check
that the bare-Celery reference runs configured like WorkManager's consumer task, the Redis
command count, the workers on real engines they time and the step of the progress bar.

Nothing is shared with a running system. Every topic, queue and exchange a phase makes
starts with a prefix drawn for it (``wmbench-1a2b3c4d``) and is deleted when the phase ends,
so a RabbitMQ vhost, where durable queues outlive the bench, keeps no trace of it. The node
is ``celery -A wm.bench.benchnode``: WorkManager's node with control (pidbox) and event
exchanges named after that prefix. Control commands are broadcast to every node of a vhost:
without its own exchange, the ``add_consumer`` that starting a bench worker sends would make
the nodes of another system consume the bench's queue, and theirs would reach the bench's.
"""

from __future__ import annotations

import contextlib
import re
import socket
import statistics
import subprocess
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from celery import Celery
from kombu import pools

from wm.config import Settings
from wm.dataplane.app import BROKER_ERRORS, make_app, redis_broker
from wm.dataplane.bus import Bus
from wm.dataplane.queues import DELIVER_TASK, EXCHANGE, subscription_queue, worker_queue_name
from wm.local.up import celery_node
from wm.manager import WorkManager
from wm.state.connection import pooled_client
from wm.views import WorkerInfo

#: The brokers ``wm bench --broker`` runs the drain and round-trip phases on.
BROKERS = ("redis", "amqp")
#: Where ``wm bench --broker amqp`` finds RabbitMQ unless ``--broker-url`` names another.
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
#: Seconds a control command (ping, inspect, consumer changes) waits for the node's reply.
CONTROL_TIMEOUT_S = 5.0
#: Tries of a control command whose connection went silent, and the seconds a read or write
#: of the bench's own app on RabbitMQ may wait (py-amqp waits for ever by default: a
#: broadcast once hung in its ``basic_cancel``).
CONTROL_ATTEMPTS = 3
AMQP_SOCKET_TIMEOUT_S = 30
#: Broker connections (and producers) of the bench's app beyond two per node it starts.
POOL_SPARE = 4
#: Keys a SCAN step of :meth:`Rig._sweep` asks for, and keys a DEL of it deletes.
SWEEP_BATCH = 1000
#: The inspect command of ``wm.bench.benchnode``: tasks its node finished with success.
SUCCEEDED_COMMAND = "wm_bench_succeeded"
#: The bare-Celery reference tasks (``wm.dataplane.tasks``), compared with ``wm.deliver``.
BARE_TASKS = ("wm.noop", "wm.echo")
#: Task options that decide when a message is acknowledged, how a task is limited and how
#: its message is encoded: the reference tasks must have ``wm.deliver``'s.
TASK_OPTIONS = (
    "acks_late",
    "acks_on_failure_or_timeout",
    "reject_on_worker_lost",
    "ignore_result",
    "track_started",
    "rate_limit",
    "time_limit",
    "soft_time_limit",
    "serializer",
    "priority",
)
STUB = "application/x-wm-stub"
NATIVE, PYTHON = "application/x-native-dll", "text/x-python"
DOTNET_DLL, CSHARP = "application/x-dotnet-dll", "text/x-csharp"
#: A Python worker that answers each event with one output of type ``<its type>.processed``,
#: as the native C example does.
PYTHON_ANSWER = b"""from wm.devkit import make_event


def process(event):
    return make_event(event.get_type() + ".processed", "/bench", event.get_data())
"""


#: Advances the progress bar: the step that begins now (``wm.bench.command._progress``).
Begin = Callable[[str], None]


@dataclass(frozen=True)
class EngineWorker:
    """A worker on a real engine, for the drain and round-trip phases: its name in the
    report, the suffix of its topic, its MIME type and code. ``processed``: it answers each
    event with one output of type ``<topic>.processed``, a topic of the bench's own; a
    worker answering to a fixed type, such as the .NET example's ``orders.done``, would
    publish to a topic a running system may use, so it is left out of these phases."""

    name: str
    suffix: str
    mime_type: str
    code: bytes
    processed: bool = True


def node_conf(prefix: str, conf: Any = None) -> dict[str, Any]:
    """Celery settings a bench node and the bench's own app share: their own exchanges and,
    on a Redis broker, their own ready list (``conf`` is the app's configuration)."""
    own: dict[str, Any] = {"control_exchange": prefix, "event_exchange": f"{prefix}.events"}
    options = dict(conf.broker_transport_options or {}) if conf is not None else {}
    if options.get("ready_key"):
        own["broker_transport_options"] = {**options, "ready_key": f"{prefix}.ready"}
    return own


class Rig:
    """One phase's names, node, workers and subscriptions; closing it deletes them all."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.prefix = f"wmbench-{uuid.uuid4().hex[:8]}"
        self.node_name = f"{self.prefix}@{socket.gethostname()}"
        self.app = make_app(settings)
        self.app.conf.update(node_conf(self.prefix, self.app.conf))
        self.manager = WorkManager(settings, bus=Bus(settings, self.app))
        self.redis_broker = redis_broker(settings.broker_url)
        if not self.redis_broker:
            options = dict(self.app.conf.broker_transport_options or {})
            timeouts = {
                "read_timeout": AMQP_SOCKET_TIMEOUT_S,
                "write_timeout": AMQP_SOCKET_TIMEOUT_S,
            }
            self.app.conf.broker_transport_options = {**options, **timeouts}
        self.queues: list[str] = []
        #: The bare reference's queues (classic ones), among :attr:`queues`.
        self.bare: list[str] = []
        self._workers: list[str] = []
        self._subscriptions: list[tuple[str, str]] = []

    def __enter__(self) -> Rig:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def name(self, suffix: str) -> str:
        return f"{self.prefix}.{suffix}"

    def queue(self, suffix: str) -> str:
        """Declare a queue of the bare reference, which no worker owns: a classic queue
        whatever ``WM_AMQP_QUEUE_TYPE`` says, as the node's ``-Q`` declares it (with no
        arguments; RabbitMQ refuses a second declaration that differs)."""
        name = self.name(suffix)
        with self.app.connection_for_write() as connection:
            subscription_queue(name).bind(connection.default_channel).declare()
        self.queues.append(name)
        self.bare.append(name)
        return name

    def worker(
        self,
        suffix: str,
        code: bytes,
        group: str | None = None,
        mime_type: str = STUB,
        settings: Mapping[str, Any] | None = None,
    ) -> WorkerInfo:
        """A running worker (a stub by default) on topic ``<prefix>.<suffix>``."""
        topic = self.name(suffix)
        info = self.manager.create_worker(
            code=code,
            mime_type=mime_type,
            topic=topic,
            group=group and self.name(group),
            settings=settings,
        )
        self._workers.append(str(info.id))
        self.queues.append(worker_queue_name(topic, str(info.id)))
        return info

    def subscribe(self, suffix: str, name: str) -> str:
        """A plain subscription of topic ``<prefix>.<suffix>``; returns its queue."""
        topic = self.name(suffix)
        queue = self.manager.subscribe(topic, name)
        self._subscriptions.append((topic, name))
        self.queues.append(queue)
        return queue

    @contextlib.contextmanager
    def node(
        self,
        home: Path,
        concurrency: int,
        queues: Sequence[str],
        *,
        name_suffix: str = "",
        pool: str = "prefork",
    ) -> Iterator[subprocess.Popen[bytes]]:
        """The bench's node, consuming ``queues`` and every running worker's queue.

        A phase with several nodes tells them apart with ``name_suffix``, appended to the
        node's name (``<prefix>@<host><suffix>``; the part before ``@``, which names the
        node's exchanges, stays the prefix). Entered once any node of the phase answers;
        yields the node's main process. Its log level is WARNING (``wm.bench.benchnode``)."""
        with celery_node(
            home,
            self.settings,
            concurrency,
            queues,
            app_module="wm.bench.benchnode",
            name=self.node_name + name_suffix,
            control=self.app,
            pool=pool,
        ) as process:
            yield process

    def control(self, command: str, **arguments: Any) -> Any:
        """The node's reply to a control command; raises if it gives none in time."""
        for attempt in range(1, CONTROL_ATTEMPTS + 1):
            try:
                replies = self.app.control.broadcast(
                    command,
                    arguments=arguments,
                    destination=[self.node_name],
                    reply=True,
                    timeout=CONTROL_TIMEOUT_S,
                )
                break
            except BROKER_ERRORS:  # its connection went silent or broke: on a new one
                self.app.pool.force_close_all()
                if attempt == CONTROL_ATTEMPTS:
                    raise
        for reply in replies or []:
            if self.node_name in reply:
                return reply[self.node_name]
        raise RuntimeError(f"node {self.node_name} did not answer {command!r}")

    def pause(self, queue: str) -> None:
        """Stop consuming a reference queue."""
        self.control("cancel_consumer", queue=queue)

    def resume(self, queue: str) -> None:
        """Consume a reference queue again (through WorkManager's exchange, as a worker's)."""
        self.control(
            "add_consumer",
            queue=queue,
            exchange=EXCHANGE.name,
            exchange_type="direct",
            routing_key=queue,
        )

    def succeeded(self) -> int:
        """Tasks the node has finished with success since it started (one per task id)."""
        return int(self.control(SUCCEEDED_COMMAND)["succeeded"])

    def describe_node(self) -> str:
        """One line on how the node runs every side; raises if the reference differs."""
        stats = self.control("stats")
        conf = self.control("conf", with_defaults=True)
        registered = self.control("registered", taskinfoitems=list(TASK_OPTIONS))
        options = task_options(registered)
        differences = mismatches(options)
        if differences:
            raise SystemExit(
                "wm bench: the bare-Celery reference is not configured like wm.deliver ("
                + "; ".join(differences)
                + "): align the reference tasks in wm/dataplane/tasks.py"
            )
        pool = stats["pool"]
        events = "on" if conf.get("worker_send_task_events") else "off"
        shown = " ".join(f"{key}={value}" for key, value in sorted(options[DELIVER_TASK].items()))
        return (
            f"node {self.node_name}: {pool['implementation']}, {pool['max-concurrency']} "
            f"processes, prefetch {stats['prefetch_count']} (multiplier "
            f"{conf.get('worker_prefetch_multiplier')}), task events {events}, acks late "
            f"{conf.get('task_acks_late')}; {', '.join(BARE_TASKS)} configured like "
            f"{DELIVER_TASK} ({shown})"
        )

    @property
    def counted(self) -> str:
        """What :meth:`redis_commands` counts: broker and state, or the state store alone."""
        return "Redis commands" if self.redis_broker else "state-store Redis commands"

    def redis_commands(self) -> int:
        """Commands executed so far by the Redis servers of broker and state store (INFO
        commandstats, the INFO itself included); on RabbitMQ, the state store's only."""
        total = 0
        for url in self._redis_servers():
            stats = pooled_client(url).info("commandstats")
            total += sum(int(stat["calls"]) for stat in stats.values())
        return total

    @property
    def info_calls(self) -> int:
        """INFO commands one :meth:`redis_commands` sends."""
        return len(self._redis_servers())

    def _redis_servers(self) -> list[str]:
        urls = [self.settings.redis_url]
        if self.redis_broker:
            urls.insert(0, self.settings.broker_url)
        servers = {urlsplit(url)._replace(path="").geturl(): url for url in reversed(urls)}
        return list(servers.values())

    def close(self) -> None:
        """Delete the workers, subscriptions and queues made, on RabbitMQ the exchanges the
        node and the reference queues created, on Redis the ready list, then every key left
        of them (:meth:`_sweep`); every step is tried even if one fails."""
        workers, subscriptions = self._workers, self._subscriptions
        self._workers, self._subscriptions = [], []
        with contextlib.ExitStack() as steps:  # its callbacks run last-in, first-out
            steps.callback(self._sweep, workers)
            steps.callback(self.app.close)  # its connections stay in kombu's shared pools
            if not self.redis_broker:
                steps.callback(self._delete_exchanges)
            ready = (self.app.conf.broker_transport_options or {}).get("ready_key")
            if ready:  # names left of queues deleted: nobody would take them off
                steps.callback(self._delete_key, ready)
            for queue in (q for q in self.queues if "::" not in q):
                bare = queue in self.bare
                steps.callback(self._delete_bare if bare else self.manager.bus.delete_queue, queue)
            for topic, name in subscriptions:
                steps.callback(self.manager.unsubscribe, topic, name)
            for worker_id in workers:
                steps.callback(self.manager.delete_worker, worker_id)

    def _sweep(self, workers: list[str]) -> None:
        """Delete what its deleted names and workers leave in the Redis databases of broker
        and state store: kombu's bindings, the topics' flags and the markers of outputs
        published once (named after the prefix), the workers' outcome records and cache
        generations (tagged with their ids), which would otherwise end only after
        WM_OUTCOME_TTL_S or a day in a Redis the bench was pointed at. One SCAN of each
        database (a scale phase's thousand workers are looked for in the same pass)."""
        urls = [self.settings.redis_url]
        if self.redis_broker:
            urls.append(self.settings.broker_url)
        tags = {f"{{{worker}}}" for worker in workers}
        for url in dict.fromkeys(urls):
            client = pooled_client(url)
            found = [key for key in client.scan_iter(count=SWEEP_BATCH) if self._left(key, tags)]
            for start in range(0, len(found), SWEEP_BATCH):
                client.delete(*found[start : start + SWEEP_BATCH])

    def _left(self, key: bytes | str, tags: set[str]) -> bool:
        """Whether ``key`` is one of the bench's own (:meth:`_sweep`)."""
        name = key.decode(errors="replace") if isinstance(key, bytes) else key
        opened = name.find("{")
        tag = name[opened : name.find("}", opened) + 1] if opened >= 0 else ""
        return self.prefix in name or tag in tags

    def _delete_bare(self, name: str) -> None:
        with self.app.connection_for_write() as connection:
            bound = subscription_queue(name).bind(connection.default_channel)
            bound.declare()  # kombu's virtual transports delete only bindings a channel knows
            bound.delete()

    def _delete_key(self, key: str) -> None:
        with (
            self.app.connection_for_write() as connection,
            connection.default_channel.conn_or_acquire() as client,
        ):
            client.delete(key)

    def _delete_exchanges(self) -> None:
        with self.app.connection_for_write() as connection:
            channel = connection.default_channel
            for exchange in self.exchanges:
                channel.exchange_delete(exchange)

    @property
    def exchanges(self) -> list[str]:
        """Exchanges of the bench's own: control, replies, events, and the one Celery makes
        for each queue a node is started with (``-Q``)."""
        pidbox = f"{self.prefix}.pidbox"
        own = [pidbox, f"reply.{pidbox}", node_conf(self.prefix)["event_exchange"]]
        return own + [q for q in self.queues if "::" not in q]


def size_pools(app: Celery, nodes: int) -> None:
    """Room in the broker pools for ``nodes`` nodes: the threads that start and ping many
    nodes each hold a connection and a producer at once, and with Celery's default limit of
    10 (``broker_pool_limit``) more than about nine nodes deadlock at start. kombu's pools
    and their limit are the process's, not the app's, and an app sets the limit to its own
    ``broker_pool_limit`` when it first uses its pool: the limit only grows, on every app
    of the bench that is given it."""
    limit = max(pools.get_limit() or 0, app.conf.broker_pool_limit or 0, 2 * nodes + POOL_SPARE)
    app.conf.broker_pool_limit = limit
    pools.set_limit(limit)


_REGISTERED = re.compile(r"^(?P<name>\S+)(?: \[(?P<options>.*)\])?$")


def task_options(registered: Sequence[str]) -> dict[str, dict[str, str]]:
    """Task name → option → value, from ``inspect registered`` with option names (an option
    whose value is None is left out by Celery)."""
    options: dict[str, dict[str, str]] = {}
    for line in registered:
        match = _REGISTERED.match(line)
        if match is None:
            continue
        pairs = (item.partition("=") for item in (match["options"] or "").split())
        options[match["name"]] = {key: value for key, _, value in pairs}
    return options


def mismatches(options: dict[str, dict[str, str]]) -> list[str]:
    """How each reference task's options differ from ``wm.deliver``'s (nothing: alike)."""
    deliver = options.get(DELIVER_TASK)
    if deliver is None:
        return [f"the node does not run {DELIVER_TASK}"]
    found = []
    for name in BARE_TASKS:
        bare = options.get(name)
        if bare is None:
            found.append(f"the node does not run {name}")
            continue
        for key in sorted(set(bare) | set(deliver)):
            if bare.get(key) != deliver.get(key):
                found.append(f"{name} {key}={bare.get(key)}, {DELIVER_TASK} {deliver.get(key)}")
    return found


def percentile(samples: Sequence[float], q: int) -> float:
    """The ``q``-th percentile (1 to 99) of ``samples``, 0.0 for none: the standard library's
    quantiles, inclusive (the samples are every event timed, not a sample of more)."""
    if len(samples) < 2:
        return float(samples[0]) if samples else 0.0
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]
