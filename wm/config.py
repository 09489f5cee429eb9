"""One frozen, typed settings object read from the environment.

Names come from the seeds where they exist; every other variable is prefixed ``WM_``.
Units are part of the names. An unknown ``WM_*`` variable or a malformed value stops
start-up with a message that names the variable and what it expects.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import parse_qs, urlsplit

from wm import sentinelurl
from wm.errors import ConfigurationError, InvalidArgument
from wm.names import DEFAULT_TENANT, check_tenant

#: Pure-stdlib modules a sandboxed Python worker may import when nothing else is configured.
DEFAULT_PYTHON_ALLOWED_PACKAGES = (
    "json,math,re,datetime,time,collections,itertools,functools,operator,string,decimal,"
    "fractions,statistics,random,uuid,base64,hashlib,hmac,enum,dataclasses,typing,copy,"
    "heapq,bisect,textwrap,unicodedata,zlib,binascii,struct,abc,numbers,contextlib,"
    "calendar,array,pprint"
)


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _parse_int(raw: str) -> int:
    value = int(raw.strip())
    if value < 0:
        raise ValueError("expected a non-negative integer")
    return value


def _parse_float(raw: str) -> float:
    value = float(raw.strip())
    if value < 0:
        raise ValueError("expected a non-negative number")
    return value


def _parse_positive_int(raw: str) -> int:
    value = int(raw.strip())
    if value < 1:
        raise ValueError("expected a positive integer")
    return value


def _parse_positive_float(raw: str) -> float:
    value = float(raw.strip())
    if not value > 0:
        raise ValueError("expected a positive number")
    return value


#: Longest WM_ENGINE_SPIN_US: a spin is worth a wake-up, tens of µs, not milliseconds.
MAX_SPIN_US = 10_000


def _parse_spin_us(raw: str) -> int:
    value = int(raw.strip())
    if not 0 <= value <= MAX_SPIN_US:
        raise ValueError("out of range")
    return value


def _parse_port(raw: str) -> int:
    value = int(raw.strip())
    if not 0 <= value <= 65535:
        raise ValueError("expected a TCP port, 0 to 65535")
    return value


def _parse_csv(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def _parse_str(raw: str) -> str:
    return raw.strip()


#: Message priorities kombu's Redis transport knows (it clamps a message's priority to them).
MAX_PRIORITY = 9


def _parse_priority_steps(raw: str) -> tuple[int, ...]:
    steps = tuple(int(item) for item in _parse_csv(raw))
    if not steps or steps[0] != 0 or steps[-1] > MAX_PRIORITY or list(steps) != sorted(set(steps)):
        raise ValueError("expected ascending priority levels")
    return steps


#: Values of WM_LOG_FORMAT: lines for people, or one JSON object per line for a collector.
LOG_FORMATS = ("text", "json")


def _parse_log_format(raw: str) -> str:
    value = raw.strip().lower()
    if value not in LOG_FORMATS:
        raise ValueError(f"expected {' or '.join(LOG_FORMATS)}")
    return value


#: Values of WM_AMQP_QUEUE_TYPE: RabbitMQ's queue types WorkManager declares.
QUEUE_TYPES = ("classic", "quorum")


def _parse_queue_type(raw: str) -> str:
    value = raw.strip().lower()
    if value not in QUEUE_TYPES:
        raise ValueError(f"expected {' or '.join(QUEUE_TYPES)}")
    return value


def _parse_delivery_limit(raw: str) -> int:
    value = _parse_int(raw)
    if value < 1:
        raise ValueError("expected a whole number of deliveries, at least 1")
    return value


def _url(raw: str, schemes: tuple[str, ...] | None, expects: str) -> str:
    """``raw`` if it is a URL (of one of ``schemes``, unless None) whose port, if any, is a
    number; else a ValueError saying what is wrong with it."""
    url = raw.strip()
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise ValueError(f"not a URL (no scheme://); expected {expects}")
    if schemes is not None and scheme.lower() not in schemes:
        raise ValueError(f"the scheme {scheme!r} is not one WorkManager takes; expected {expects}")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"not a URL ({exc}); expected {expects}") from None
    try:
        parts.port  # noqa: B018 -- reading it checks it
    except ValueError:
        port = parts.netloc.rpartition("@")[2].rpartition(":")[2]
        raise ValueError(f"the port {port!r} is not a number from 0 to 65535") from None
    return url


def _parse_database_url(raw: str) -> str:
    """Syntax only: the dialect and its driver are judged when the engine is made."""
    return _url(raw, None, "postgresql+psycopg://USER@HOST:PORT/DB or sqlite:///PATH")


#: Brokers kombu offers WorkManager: Redis, RabbitMQ, and kombu's in-process memory transport.
BROKER_SCHEMES = ("redis", "rediss", "amqp", "amqps", "pyamqp", "memory")


def _parse_broker_url(raw: str) -> str:
    if sentinelurl.is_sentinel(raw):
        sentinelurl.parse(raw)  # a ValueError says what is wrong
        return raw.strip()
    return _url(
        raw,
        BROKER_SCHEMES,
        "redis://HOST:PORT/DB, amqp://USER:PASSWORD@HOST:PORT/VHOST or " + sentinelurl.EXPECTED,
    )


def _parse_api_url(raw: str) -> str:
    """Empty (the commands use the database, broker and Redis themselves), or http(s)."""
    if not raw.strip():
        return ""
    return _url(raw, ("http", "https"), "https://HOST:PORT (the admin API, `wm api`)").rstrip("/")


def _parse_redis_url(raw: str) -> str:
    if sentinelurl.is_sentinel(raw):
        sentinelurl.parse(raw)  # a ValueError says what is wrong
        return raw.strip()
    return _url(
        raw,
        ("redis", "rediss", "unix"),
        f"redis://HOST:PORT/DB (or rediss://, unix://, {sentinelurl.EXPECTED})",
    )


#: What WM_DEPLOYMENT may be: it names AMQP exchanges and Redis channels.
DEPLOYMENT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _parse_tenant(raw: str) -> str:
    try:
        return check_tenant(raw.strip())
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None


def _parse_deployment(raw: str) -> str:
    value = raw.strip()
    if value and not DEPLOYMENT_PATTERN.fullmatch(value):
        raise ValueError("expected a deployment name")
    return value


_EXPECTS: dict[Callable[[str], Any], str] = {
    _parse_bool: "true or false",
    _parse_int: "a non-negative integer",
    _parse_positive_int: "a positive integer",
    _parse_float: "a non-negative number",
    _parse_port: "a TCP port (0 to 65535; 0 is off)",
    _parse_spin_us: f"0 to {MAX_SPIN_US} microseconds",
    _parse_csv: "a comma-separated list",
    _parse_str: "a string",
    _parse_tenant: "a tenant name (1-63 of a-z, 0-9 and -, starting with a letter or digit)",
    _parse_priority_steps: f"ascending levels from 0 to {MAX_PRIORITY}, starting with 0 "
    "(0, or 0,3,6,9)",
    _parse_log_format: " or ".join(LOG_FORMATS),
    _parse_deployment: "up to 64 letters, digits, '.', '-' or '_', starting with a letter or "
    "digit (empty: derived from WM_REDIS_URL's database number)",
}


def _setting(env: str, default: Any, parse: Callable[[str], Any], doc: str) -> Any:
    return field(default=default, metadata={"env": env, "parse": parse, "doc": doc})


@dataclass(frozen=True)
class Settings:
    """Everything WorkManager reads from the environment, parsed and validated once."""

    database_url: str = _setting(
        "WM_DATABASE_URL",
        "sqlite:///.wm/workmanager.db",
        _parse_database_url,
        "SQLAlchemy URL of the worker store (PostgreSQL in production, SQLite embedded).",
    )
    broker_url: str = _setting(
        "WM_BROKER_URL",
        "redis://127.0.0.1:6379/0",
        _parse_broker_url,
        "Celery/kombu broker URL: redis://…, amqp://… or, through Redis Sentinel, "
        "`sentinel://HOST:26379;sentinel://HOST:26379/DB?master_name=NAME`.",
    )
    amqp_queue_type: str = _setting(
        "WM_AMQP_QUEUE_TYPE",
        "classic",
        _parse_queue_type,
        "RabbitMQ: `classic` queues live on one server; `quorum` queues are replicated over "
        "a cluster and survive losing a server (needs every node, beat and client on the same "
        "value; a deployment switching type needs new queues). Redis ignores it.",
    )
    amqp_delivery_limit: int = _setting(
        "WM_AMQP_DELIVERY_LIMIT",
        1000,
        _parse_delivery_limit,
        "Quorum queues: a message RabbitMQ has delivered this often without an "
        "acknowledgement goes to `wm.default`, where a node dead-letters it (never dropped); "
        "WorkManager's own limits (attempts, WM_REQUEUE_LIMIT_S) normally park it long before.",
    )
    redis_url: str = _setting(
        "WM_REDIS_URL",
        "redis://127.0.0.1:6379/1",
        _parse_redis_url,
        "Redis for derived state: routing table, locks, fences, outcomes, leases; "
        "`sentinel://HOST:26379;sentinel://HOST:26379/DB?master_name=NAME` follows the "
        "primary a Redis Sentinel names.",
    )
    redis_wait_replicas: int = _setting(
        "WM_REDIS_WAIT_REPLICAS",
        0,
        _parse_int,
        "Replicas of the state store that must acknowledge a group-lock acquire (its fence) "
        "and a recorded outcome (Redis WAIT) before WorkManager goes on; 0 does not wait.",
    )
    redis_wait_timeout_ms: int = _setting(
        "WM_REDIS_WAIT_TIMEOUT_MS",
        500,
        _parse_positive_int,
        "How long WM_REDIS_WAIT_REPLICAS and WM_BROKER_WAIT_REPLICAS wait for the replicas; "
        "fewer acknowledgements is an outage: the delivery goes back to its queue, a publish "
        "fails.",
    )
    broker_wait_replicas: int = _setting(
        "WM_BROKER_WAIT_REPLICAS",
        0,
        _parse_int,
        "Replicas of a Redis broker that must acknowledge each publish (Redis WAIT) before "
        "the publisher is told it succeeded; 0 does not wait. A Redis broker only.",
    )
    deployment: str = _setting(
        "WM_DEPLOYMENT",
        "",
        _parse_deployment,
        "Name of the deployment on servers it shares with others: its Redis channel and its "
        "Celery control and event exchanges carry it. Empty means `db<N>`, N being "
        "WM_REDIS_URL's database number. Set it alike on every node and client.",
    )
    tenant: str = _setting(
        "WM_TENANT",
        DEFAULT_TENANT,
        _parse_tenant,
        "The tenant `wm` commands and `WorkManager()` work in when none is given (`--tenant`, "
        "`tenant=`); it must exist (`wm tenant create`). Nodes serve every tenant.",
    )
    group_lock_retry_base_delay_ms: int = _setting(
        "GROUP_LOCK_RETRY_BASE_DELAY_MS",
        500,
        _parse_int,
        "Group-lock wait base: wait n of a delivery lasts ½–1 × base × 2^n (≤ half a lease).",
    )
    group_lock_max_retries: int = _setting(
        "GROUP_LOCK_MAX_RETRIES",
        3000,
        _parse_int,
        "Waits for a group lock (or slot) before the delivery is dead-lettered as "
        "LockContention, ≥ 1 h by default (0 waits for ever).",
    )
    group_lock_lease_s: float = _setting(
        "WM_GROUP_LOCK_LEASE_S",
        5.0,
        _parse_float,
        "Group-lock lease: renewed while its holder runs; a dead holder's lock is free after it.",
    )
    group_lock_handoff_ms: int = _setting(
        "WM_GROUP_LOCK_HANDOFF_MS",
        50,
        _parse_int,
        "Wait in-process for a held group lock's release, then in the broker (≤ ¼ lease, 0 never).",
    )
    worker_recovery_on_start: bool = _setting(
        "WORKER_RECOVERY_ON_START",
        True,
        _parse_bool,
        "Reconcile Redis and queues with the database when a node starts.",
    )
    worker_recovery_lease_ttl_seconds: int = _setting(
        "WORKER_RECOVERY_LEASE_TTL_SECONDS",
        300,
        _parse_int,
        "TTL of the recovery leader lease, never renewed: a leader killed mid-recovery is "
        "taken over by a running node this long after it took the lease. Shorter resumes "
        "sooner, but a recovery that outlasts it is joined by a second node (harmless, "
        "repeated work).",
    )
    worker_recovery_acquire_timeout_seconds: int = _setting(
        "WORKER_RECOVERY_ACQUIRE_TIMEOUT_SECONDS",
        30,
        _parse_int,
        "How long a starting node retries a recovery that fails (broker, Redis or database "
        "away) before it gives up and stops; longer rides out a longer outage at start.",
    )
    python_allowed_packages: tuple[str, ...] = _setting(
        "PYTHON_ALLOWED_PACKAGES",
        _parse_csv(DEFAULT_PYTHON_ALLOWED_PACKAGES),
        _parse_csv,
        "Top-level modules a Python worker may import (plus the DevKit).",
    )
    sandbox_require: tuple[str, ...] = _setting(
        "WM_SANDBOX_REQUIRE",
        (),
        _parse_csv,
        "Python sandbox layers that must be active or the engine refuses to start "
        "(e.g. network namespace,seccomp).",
    )
    sandbox_memory_mb: int = _setting(
        "WM_SANDBOX_MEMORY_MB",
        1024,
        _parse_int,
        "Memory (MiB) one Python sandbox or isolation helper and every process it starts may "
        "use together, enforced by a cgroup of its own where the host has cgroups; 0: no limit.",
    )
    sandbox_max_processes: int = _setting(
        "WM_SANDBOX_MAX_PROCESSES",
        64,
        _parse_int,
        "Processes and threads one Python sandbox or isolation helper may have together "
        "(cgroup pids limit); 0: no limit.",
    )
    engine_spin_us: int = _setting(
        "WM_ENGINE_SPIN_US",
        100,
        _parse_spin_us,
        "Microseconds a node process and a Python sandbox or isolation helper poll for each "
        "other's next frame before they sleep on it (stopped for a while wherever it came to "
        "nothing); 0: they sleep at once.",
    )
    message_handling_timeout_seconds: float = _setting(
        "MESSAGE_HANDLING_TIMEOUT_SECONDS",
        30.0,
        _parse_float,
        "Per-message time limit of worker code (a worker's settings may override it).",
    )
    max_retries: int = _setting(
        "WM_MAX_RETRIES",
        5,
        _parse_int,
        "Deliveries retried before dead-lettering (a worker's settings may override it).",
    )
    max_hops: int = _setting(
        "WM_MAX_HOPS",
        16,
        _parse_int,
        "Workers an event may pass through in a chain; one further is dead-lettered.",
    )
    retry_base_delay_ms: int = _setting(
        "WM_RETRY_BASE_DELAY_MS",
        1000,
        _parse_int,
        "Broker-level retry backoff base: retry n waits ½–1 × base × 2^(n-1).",
    )
    retry_max_delay_ms: int = _setting(
        "WM_RETRY_MAX_DELAY_MS",
        60000,
        _parse_int,
        "Upper bound of one retry delay.",
    )
    max_output_bytes: int = _setting(
        "WM_MAX_OUTPUT_BYTES",
        16 * 1024 * 1024,
        _parse_int,
        "Largest outcome of one message (its output events as recorded, JSON), for every "
        "engine; a larger one is dead-lettered as OutputTooLarge.",
    )
    code_max_bytes: int = _setting(
        "WM_CODE_MAX_BYTES",
        16 * 1024 * 1024,
        _parse_int,
        "Largest code payload accepted inline or from a URL.",
    )
    code_url_allowed_hosts: tuple[str, ...] = _setting(
        "WM_CODE_URL_ALLOWED_HOSTS",
        (),
        _parse_csv,
        "Hosts code URLs may name (exact or *.suffix); empty admits any public host.",
    )
    code_url_allow_http: bool = _setting(
        "WM_CODE_URL_ALLOW_HTTP",
        False,
        _parse_bool,
        "Admit plain http:// code URLs.",
    )
    code_url_allow_private: bool = _setting(
        "WM_CODE_URL_ALLOW_PRIVATE",
        False,
        _parse_bool,
        "Admit loopback/private addresses for code URLs (tests and closed networks only).",
    )
    code_url_timeout_s: float = _setting(
        "WM_CODE_URL_TIMEOUT_S",
        10.0,
        _parse_float,
        "Total time limit of one code fetch.",
    )
    code_url_max_redirects: int = _setting(
        "WM_CODE_URL_MAX_REDIRECTS",
        3,
        _parse_int,
        "Redirects followed, each re-checked.",
    )
    gateway_allowed_hosts: tuple[str, ...] = _setting(
        "WM_GATEWAY_ALLOWED_HOSTS",
        (),
        _parse_csv,
        "Hosts a worker's gateway calls may reach (through the host); empty refuses all.",
    )
    gateway_timeout_s: float = _setting(
        "WM_GATEWAY_TIMEOUT_S",
        10.0,
        _parse_float,
        "Time limit of one gateway call.",
    )
    dotnet_cache_dir: str = _setting(
        "WM_DOTNET_CACHE_DIR",
        "",
        _parse_str,
        "Where the .NET engine keeps the DevKit and host assemblies it builds, by hash; "
        "empty means $XDG_CACHE_HOME/workmanager/dotnet (~/.cache/workmanager/dotnet).",
    )
    flower_show_data: bool = _setting(
        "WM_FLOWER_SHOW_DATA",
        False,
        _parse_bool,
        "Show each delivery's event (its data too) as the task's arguments in Flower and "
        "Celery's logs; off, they show the event's id, type and the attempt only.",
    )
    task_events: bool = _setting(
        "WM_TASK_EVENTS",
        False,
        _parse_bool,
        "Celery task events from nodes (received, started, succeeded, failed) and publishers "
        "(sent). Off by default: each costs a broker publish. Flower switches a node's on "
        "while it watches (its enable_events).",
    )
    infra_events: bool = _setting(
        "WM_INFRA_EVENTS",
        False,
        _parse_bool,
        "Publish node heartbeats (workmanager.infra.heartbeat) and group-lock changes "
        "(workmanager.infra.grouplock). Off by default: a heartbeat per node and interval and "
        "up to two lock events per group, process and second, each a publish.",
    )
    engine_cache_mb: int = _setting(
        "WM_ENGINE_CACHE_MB",
        0,
        _parse_int,
        "Memory each node process may spend on loaded workers (the resident memory of the "
        "sandbox or helper processes they keep, sampled after they run, plus what loading one "
        "added to the process); beyond it the least recently used are unloaded and reloaded on "
        "their next delivery. 0 means half the machine's memory divided by the node's processes.",
    )
    node_concurrency: int = _setting(
        "WM_NODE_CONCURRENCY",
        0,
        _parse_int,
        "Celery processes per node; 0 means one per CPU.",
    )
    prefetch_multiplier: int = _setting(
        "WM_PREFETCH_MULTIPLIER",
        4,
        _parse_int,
        "Celery prefetch multiplier.",
    )
    batch_size: int = _setting(
        "WM_BATCH_SIZE",
        1,
        _parse_int,
        "Events of one worker's queue delivered in one task run (a worker's batch_size may "
        "override it); 1: one at a time. More trades latency under load for throughput.",
    )
    reconcile_interval_s: float = _setting(
        "WM_RECONCILE_INTERVAL_S",
        10.0,
        _parse_float,
        "How often a node re-checks that it consumes every running worker's queue, and one "
        "node maintains what is derived (the pending ledger's sweep included).",
    )
    priority_steps: tuple[int, ...] = _setting(
        "WM_PRIORITY_STEPS",
        (0,),
        _parse_priority_steps,
        "Redis broker: priority levels, one list per queue each, all named in every BRPOP. "
        "0 is one level (WorkManager sends no priorities); 0,3,6,9 is kombu's default.",
    )
    ready_list: bool = _setting(
        "WM_READY_LIST",
        True,
        _parse_bool,
        "Redis broker: nodes wait on one list of worker queues that hold messages instead "
        "of naming every queue in BRPOP; set the same on nodes and publishers.",
    )
    placement_spill: int = _setting(
        "WM_PLACEMENT_SPILL",
        0,
        _parse_int,
        "Redis broker with the ready list: above 0, each worker is served by one of the live "
        "nodes (placement, experimental), so a node's processes load only their share of the "
        "workers, until its queue holds more than this many messages; then every node serves "
        "it. 0 (the default): every node serves every worker.",
    )
    visibility_timeout_s: int = _setting(
        "WM_VISIBILITY_TIMEOUT_S",
        3600,
        _parse_int,
        "Redis broker, the last resort: a message unacknowledged this long with no live node "
        "holding it (taken by a client that keeps no heartbeat) is delivered again.",
    )
    node_heartbeat_s: float = _setting(
        "WM_NODE_HEARTBEAT_S",
        2.0,
        _parse_float,
        "Redis broker: how often a node renews its liveness record and the time of the "
        "messages it holds, and puts back the messages of nodes found dead.",
    )
    node_dead_after_s: float = _setting(
        "WM_NODE_DEAD_AFTER_S",
        10.0,
        _parse_float,
        "Redis broker: a node whose liveness record is this old counts as dead and the "
        "messages it held go back to their queues (at least 2 heartbeats).",
    )
    redeliver_after_s: float = _setting(
        "WM_REDELIVER_AFTER_S",
        3600.0,
        _parse_float,
        "A delivery still pending after this is sent again (covers messages a broker lost).",
    )
    requeue_limit_s: float = _setting(
        "WM_REQUEUE_LIMIT_S",
        300.0,
        _parse_positive_float,
        "A message that keeps going back to its queue (the platform unavailable, its worker "
        "paused) for this long, with no break as long, is dead-lettered naming the cause.",
    )
    outcome_ttl_s: int = _setting(
        "WM_OUTCOME_TTL_S",
        7 * 24 * 3600,
        _parse_int,
        "How long recorded outcomes (idempotency records) are kept in Redis.",
    )
    shutdown_grace_s: float = _setting(
        "WM_SHUTDOWN_GRACE_S",
        25.0,
        _parse_float,
        "How long a node stopping (SIGTERM) lets deliveries in flight finish before it ends "
        "them (they are delivered again), and `wm api` its requests in flight. 0 waits for ever.",
    )
    health_port: int = _setting(
        "WM_HEALTH_PORT",
        0,
        _parse_port,
        "Port of a node's health endpoints (`/health`, `/health/live`, `/health/ready`), "
        "served by its main process; 0 is off.",
    )
    health_bind: str = _setting(
        "WM_HEALTH_BIND",
        "127.0.0.1",
        _parse_str,
        "Address the health endpoints listen on (`0.0.0.0` for a probe from another host).",
    )
    api_bind: str = _setting(
        "WM_API_BIND",
        "127.0.0.1",
        _parse_str,
        "Address `wm api` listens on. Any other than a loopback address needs TLS "
        "(`WM_API_TLS_CERT`, `WM_API_TLS_KEY`) or `wm api --insecure`.",
    )
    api_port: int = _setting(
        "WM_API_PORT",
        8080,
        _parse_port,
        "Port of the admin HTTP API (`wm api`).",
    )
    api_tls_cert: str = _setting(
        "WM_API_TLS_CERT",
        "",
        _parse_str,
        "PEM certificate (chain) `wm api` serves HTTPS with; empty serves plain HTTP.",
    )
    api_tls_key: str = _setting(
        "WM_API_TLS_KEY",
        "",
        _parse_str,
        "PEM private key of `WM_API_TLS_CERT`.",
    )
    api_max_body_bytes: int = _setting(
        "WM_API_MAX_BODY_BYTES",
        1024 * 1024,
        _parse_int,
        "Largest request body `wm api` takes (413 beyond it, before it is read); inline "
        "code rides in the body as text or base64, so larger code goes by `url`.",
    )
    api_url: str = _setting(
        "WM_API_URL",
        "",
        _parse_api_url,
        "The admin API `wm`'s read commands ask instead of reading the database, broker and "
        "Redis themselves (`https://HOST:PORT`; the others still need them): a command then "
        "starts in a fraction of the time and needs only a token (`WM_API_TOKEN`). Empty: "
        "every command reads them itself.",
    )
    api_token: str = _setting(
        "WM_API_TOKEN",
        "",
        _parse_str,
        "The bearer token `wm` sends to `WM_API_URL` (`wm token create`); the commands see "
        "what its role and tenant may.",
    )
    log_level: str = _setting(
        "WM_LOG_LEVEL",
        "WARNING",
        _parse_str,
        "Logging level of the `wm` command (DEBUG…ERROR).",
    )
    log_format: str = _setting(
        "WM_LOG_FORMAT",
        "text",
        _parse_log_format,
        "Log lines of the `wm` command and the nodes: `text`, or `json` (one object per line). "
        "Lines logged during a delivery carry its worker, event id, correlation id, topic and "
        "attempt: JSON fields, or `[worker=… event=… correlation=… attempt=…]` in text.",
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Build settings from ``environ`` (default ``os.environ``), refusing bad input."""
        env = os.environ if environ is None else environ
        known = {f.metadata["env"]: f for f in fields(cls)}
        _refuse_unknown(env, {**known, **{name + FILE_SUFFIX: None for name in FROM_FILE}})
        values: dict[str, Any] = {}
        for name, f in known.items():
            raw = _read_file(env, name) if name in FROM_FILE else env.get(name)
            if raw is None:
                continue
            parse = f.metadata["parse"]
            try:
                values[f.name] = parse(raw)
            except ValueError as exc:
                shown = _without_password(raw) if name in FROM_FILE else raw
                why = f"expected {_EXPECTS[parse]}" if parse in _EXPECTS else str(exc)
                raise ConfigurationError(f"{name}={shown!r} is malformed: {why}") from exc
        return cls(**values)

    @property
    def engine_spin_s(self) -> float:
        """WM_ENGINE_SPIN_US in seconds."""
        return self.engine_spin_us / 1e6

    def replace(self, **changes: Any) -> Settings:
        """Return a copy with ``changes`` applied (settings stay immutable)."""
        current = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(current)
        if unknown:
            raise ConfigurationError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        current.update(changes)
        return Settings(**current)


#: Settings that may be read from a file named by ``<VARIABLE>_FILE`` instead
#: (``WM_DATABASE_URL_FILE=/run/secrets/db-url``): the URLs, which hold passwords, the way
#: Docker and Kubernetes secrets hand them over, never in the process environment.
FROM_FILE = ("WM_DATABASE_URL", "WM_BROKER_URL", "WM_REDIS_URL", "WM_API_TOKEN")
FILE_SUFFIX = "_FILE"


def deployment_name(settings: Settings) -> str:
    """WM_DEPLOYMENT, or ``db<N>`` for the database number N of WM_REDIS_URL: the one thing
    every node and client of a deployment agrees on (they share its state store), whatever
    host name each reaches the server by, and that two deployments on one server differ in."""
    if settings.deployment:
        return settings.deployment
    if sentinelurl.is_sentinel(settings.redis_url):
        return f"db{sentinelurl.parse(settings.redis_url).db}"
    url = urlsplit(settings.redis_url)
    db = parse_qs(url.query).get("db", [url.path.strip("/") or "0"])[0]
    if not db.isdigit():
        raise ConfigurationError(
            f"WM_REDIS_URL names database {db!r}: expected a number (redis://host:6379/1)"
        )
    return f"db{int(db)}"


def given(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` is set in ``env`` (default ``os.environ``), itself or by its file."""
    env = os.environ if env is None else env
    return name in env or (name in FROM_FILE and name + FILE_SUFFIX in env)


def masked(url: str) -> str:
    """``url`` with its password replaced by ``**``: how a URL is shown or logged. A broker's
    failover list (``amqp://…;amqp://…``, kombu's form) has every URL masked."""
    from kombu.utils.url import maybe_sanitize_url

    if ";" in url:
        return ";".join(masked(part) for part in url.split(";"))
    try:
        return str(maybe_sanitize_url(url))
    except ValueError:  # kombu cannot parse it (a malformed port): mask it without parsing
        return _without_password(url)


_PASSWORD = re.compile(r"(://[^:/@]*:)[^@/]*@")


def _without_password(url: str) -> str:
    return _PASSWORD.sub(r"\1**@", url)


def _read_file(env: Mapping[str, str], name: str) -> str | None:
    """``name``'s value: from the environment, or from the file ``<name>_FILE`` names
    (surrounding white space dropped); both at once is refused."""
    path = env.get(name + FILE_SUFFIX)
    if path is None:
        return env.get(name)
    if name in env:
        raise ConfigurationError(f"set {name} or {name}{FILE_SUFFIX}, not both")
    try:
        with open(path, encoding="utf-8") as secret:
            return secret.read().strip()
    except OSError as exc:
        raise ConfigurationError(
            f"{name}{FILE_SUFFIX}={path!r} cannot be read: {exc.strerror or exc}"
        ) from exc


def _refuse_unknown(env: Mapping[str, str], known: Mapping[str, Any]) -> None:
    for name in env:
        if name.startswith("WM_") and name not in known:
            hint = difflib.get_close_matches(name, list(known), n=1)
            suggestion = f" Did you mean {hint[0]}?" if hint else ""
            raise ConfigurationError(f"unknown setting {name}.{suggestion}")


#: How alike (difflib's ratio) a variable's name must be to an unprefixed setting's to count
#: as a misspelling of it: ``PYTHON_ALLOWED_PACKAGE`` is, ``PYTHONPATH`` is not.
MISSPELT_RATIO = 0.85


def misspelt(env: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each variable of ``env`` (default ``os.environ``) whose name looks like
    an unprefixed setting's (``PYTHON_ALLOWED_PACKAGES``…) but is not: it is ignored.

    Warned, not refused as an unknown ``WM_*`` variable is: names without the prefix are
    shared with every other program in the environment, where a near name may be right."""
    env = os.environ if env is None else env
    unprefixed = [f.metadata["env"] for f in fields(Settings)]
    unprefixed = [name for name in unprefixed if not name.startswith("WM_")]
    found = []
    for name in sorted(env):
        if name in unprefixed or name.startswith("WM_"):
            continue
        hint = difflib.get_close_matches(name.upper(), unprefixed, n=1, cutoff=MISSPELT_RATIO)
        if hint:
            found.append(
                f"{name} is no WorkManager setting and is ignored: did you mean {hint[0]}?"
            )
    return found


def settings_table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) rows, used by ``wm config`` and the docs."""
    return [(f.metadata["env"], _shown(f.default), f.metadata["doc"]) for f in fields(Settings)]


#: Settings that are secrets as a whole: shown as ``**`` when set (a URL has its password
#: masked instead, ``masked``).
SECRET = frozenset({"WM_API_TOKEN"})


def current_values(settings: Settings) -> dict[str, str]:
    """Variable name → the value in force, as text."""
    return {f.metadata["env"]: _shown(getattr(settings, f.name)) for f in fields(Settings)}


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
