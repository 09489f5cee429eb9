"""A node's health over HTTP, from its main process (DESIGN §9; issue 13).

With ``WM_HEALTH_PORT`` set, a node serves on ``WM_HEALTH_BIND`` (default loopback):

- ``GET /health``: ``healthy``, ``degraded`` or ``unhealthy``, with the reasons and every
  check, as JSON; 200 unless unhealthy (503), so a load balancer can use it as it is.
- ``GET /health/live``: 200 while the node's main process answers (a Kubernetes liveness
  probe: restart the node only when this fails).
- ``GET /health/ready``: 200 once the node consumes its workers' queues and reaches broker,
  Redis and database; else 503 with the reasons (a readiness probe).
- ``GET /metrics``: Prometheus metrics (``wm.ops.metrics``).

What makes a node *unhealthy*: the broker, the Redis state store or the database does not
answer within :data:`CHECK_TIMEOUT_S`, or its start-up recovery failed. *Degraded*: recovery
still running or being retried, the node not yet consuming, or a worker whose engine could
not be loaded on this node within the last hour (its pool processes record those,
``wm.state.nodehealth``). ``engines`` shows what each engine can do on this host, such as the
Python sandbox's layers in force and missing (``WM_SANDBOX_REQUIRE`` makes a missing one stop
the node instead). The answer is the main process's, whatever pool processes come and
go. The server is the standard library's WSGI server (``wsgiref``) in a daemon thread, one
thread per request: the same server prometheus-client runs its own endpoint on, and no
further dependency for a node.

``wm health [--node URL] [--json]`` prints a node's answer (:func:`fetch`) and exits 0 when
healthy, 1 when degraded, 2 when unhealthy.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import sqlalchemy as sa
from celery import bootsteps

from wm import store
from wm.config import Settings, masked
from wm.dataplane.app import broker_connection
from wm.dataplane.node import STATE
from wm.engine import engine_facts
from wm.errors import ConfigurationError, InvalidArgument, NodeUnavailable
from wm.ops import metrics
from wm.state.connection import pooled_client
from wm.state.nodehealth import EngineFailures
from wm.store import workers

#: Seconds each dependency has to answer a check.
CHECK_TIMEOUT_S = 2.0
HEALTHY, DEGRADED, UNHEALTHY = "healthy", "degraded", "unhealthy"
#: Recovery states in which the node may serve (``wm.dataplane.node.NodeState``).
RECOVERED = ("done", "elsewhere", "disabled")

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


def _broker(settings: Settings) -> None:
    with broker_connection(settings, connect_timeout=CHECK_TIMEOUT_S) as connection:
        connection.ensure_connection(max_retries=1, timeout=CHECK_TIMEOUT_S)


def _redis(settings: Settings) -> None:
    pooled_client(settings.redis_url, CHECK_TIMEOUT_S).ping()


def _database(settings: Settings) -> None:
    with store.engine_for(settings).connect() as connection:
        connection.execute(sa.text("SELECT 1"))


CHECKS: dict[str, tuple[str, Callable[[Settings], None]]] = {
    "broker": ("WM_BROKER_URL", _broker),
    "redis": ("WM_REDIS_URL", _redis),
    "database": ("WM_DATABASE_URL", _database),
}


def dependency_checks(settings: Settings) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Whether broker, Redis and database answer: each check, and a reason per failure."""
    checks: dict[str, dict[str, Any]] = {}
    reasons: list[str] = []
    for name, (variable, check) in CHECKS.items():
        url = masked(getattr(settings, variable[3:].lower()))
        try:
            check(settings)
            checks[name] = {"ok": True, "url": url}
        except Exception as exc:  # any failure to answer is the finding
            checks[name] = {"ok": False, "url": url, "error": f"{type(exc).__name__}: {exc}"}
            reasons.append(f"{name} unreachable at {variable}={url}: {exc}")
    return checks, reasons


def report(settings: Settings, node: str) -> dict[str, Any]:
    """The node's health: status, the reasons for it, and every check."""
    checks, reasons = dependency_checks(settings)
    unhealthy = bool(reasons)
    if STATE.recovery == "failed":
        unhealthy = True
        reasons.append(f"recovery failed: {STATE.error}")
    elif STATE.recovery not in RECOVERED:
        why = f" (last attempt: {STATE.error})" if STATE.error else ""
        reasons.append(f"recovery {STATE.recovery}{why}")
    if not STATE.consuming:
        reasons.append("not consuming workers' queues yet")
    failures = EngineFailures(settings).of(node) if checks["redis"]["ok"] else {}
    reasons += [f"worker {worker} cannot load here: {error}" for worker, error in failures.items()]
    engines = engine_facts(settings)
    if checks["database"]["ok"]:
        reasons += unsupported_runtimes(settings, engines)
    status = UNHEALTHY if unhealthy else DEGRADED if reasons else HEALTHY
    return {
        "status": status,
        "node": node,
        "reasons": reasons,
        "checks": checks,
        "recovery": {"state": STATE.recovery, "error": STATE.error},
        "consuming": STATE.consuming,
        "engine_failures": failures,
        "engines": engines,
    }


def unsupported_runtimes(settings: Settings, engines: dict[str, dict[str, Any]]) -> list[str]:
    """A reason for each engine whose runtime is out of support (its facts say
    ``supported: false``) and that live workers use: the runtime is in use, not only
    installed."""
    stale = {mime for mime, facts in engines.items() if facts.get("supported") is False}
    if not stale:
        return []
    with store.session_scope(settings) as session:
        used = workers.live_mime_types(session)
    return [
        f"{mime} workers run on {engines[mime]['runtime']}, out of Microsoft's support since "
        f"{engines[mime]['support_ends']}: no security fixes"
        for mime in sorted(stale & used)
    ]


def application(settings: Settings, node: str) -> Callable[..., Iterable[bytes]]:
    """The WSGI application of the three endpoints."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") != "GET":
            return _answer(start_response, 405, {"error": "only GET"})
        if path == "/metrics":
            scraped = metrics.exposition()
            if scraped is None:
                return _answer(start_response, 404, {"error": "metrics are off"})
            data, content_type = scraped
            start_response("200 OK", [("Content-Type", content_type)])
            return [data]
        if path == "/health/live":
            return _answer(start_response, 200, {"status": "alive", "node": node})
        if path in ("/health", "/health/ready"):
            found = report(settings, node)
            if path == "/health":
                return _answer(start_response, 503 if found["status"] == UNHEALTHY else 200, found)
            ready = found["status"] != UNHEALTHY and found["consuming"]
            ready = ready and found["recovery"]["state"] in RECOVERED
            body = {"status": "ready" if ready else "not ready", "reasons": found["reasons"]}
            return _answer(start_response, 200 if ready else 503, body)
        return _answer(start_response, 404, {"error": f"no endpoint {path}"})

    return app


def _answer(start_response: StartResponse, code: int, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode()
    phrase = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
    start_response(
        f"{code} {phrase[code]}",
        [("Content-Type", "application/json"), ("Content-Length", str(len(data)))],
    )
    return [data]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds would fill the node's log."""


class HealthServer(bootsteps.StartStopStep):
    """Worker bootstep: the endpoints, from the node's main process, when WM_HEALTH_PORT is
    set. Started before the consumer, so a node busy recovering already answers (degraded)."""

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.settings = Settings.from_env()
        self.server: WSGIServer | None = None

    def start(self, parent: Any) -> None:
        port = self.settings.health_port
        if not port:
            return
        bind = self.settings.health_bind
        app = application(self.settings, parent.hostname)
        try:
            self.server = make_server(bind, port, app, _Server, _Quiet)
        except OSError as exc:
            raise ConfigurationError(
                f"WM_HEALTH_PORT={port} (WM_HEALTH_BIND={bind}): cannot listen there ({exc}); "
                "pick a free port, or unset WM_HEALTH_PORT"
            ) from exc
        threading.Thread(target=self.server.serve_forever, name="wm-health", daemon=True).start()

    def stop(self, parent: Any) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        metrics.close()


def fetch(url: str) -> tuple[int, dict[str, Any]]:
    """``GET url`` of a node's health endpoint: (HTTP status, JSON body)."""
    _check_url(url)
    try:
        with urllib.request.urlopen(url, timeout=3 * CHECK_TIMEOUT_S * len(CHECKS)) as reply:
            return int(reply.status), json.loads(reply.read())
    except urllib.error.HTTPError as exc:  # 503 still carries the report
        return exc.code, json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise NodeUnavailable(
            f"no health answer from {url}: {reason}; is the node running with WM_HEALTH_PORT set?"
        ) from exc


def _check_url(url: str) -> None:
    """Refuse what is no http(s) URL with a host and a numeric port, naming what is wrong."""
    expected = "expected http://HOST:PORT/health"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- reading it checks it
    except ValueError as exc:
        raise InvalidArgument(f"--node {url}: {exc}; {expected}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"--node {url} is not an http:// URL; {expected}")
