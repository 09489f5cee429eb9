"""A RabbitMQ cluster of three nodes on this machine, for the tests of quorum queues: each
node with its own name, ports and data directory, joined with ``rabbitmqctl join_cluster``,
no plugins. Debian's ``rabbitmq-server`` package provides the programs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import free_port

BIN = Path("/usr/lib/rabbitmq/bin")
COOKIE = "WORKMANAGER-TEST-CLUSTER"


@dataclass
class RabbitNode:
    name: str
    port: int
    home: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def pid_file(self) -> Path:
        return self.home / self.name.partition("@")[0] / "pid"

    def kill(self) -> None:
        """kill -9 of the node's Erlang VM (not of its start script only)."""
        os.kill(int(self.pid_file.read_text().strip()), signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=30)


@dataclass
class RabbitCluster:
    home: Path
    nodes: list[RabbitNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        """kombu's failover form: every node, tried in turn."""
        return ";".join(node.url for node in self.nodes)

    def ctl(self, node: RabbitNode, *args: str, timeout_s: float = 60) -> str:
        env = {**os.environ, "HOME": str(self.home)}
        done = subprocess.run(
            [str(BIN / "rabbitmqctl"), "-q", "-n", node.name, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} on {node.name}: {done.stderr}")
        return done.stdout

    def leader(self, queue: str) -> RabbitNode:
        """The node that leads the quorum queue ``queue`` now."""
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                continue
            for line in self.ctl(node, "list_queues", "name", "leader").splitlines():
                name, _, leader = line.rpartition("\t")
                if name == queue:
                    return next(n for n in self.nodes if n.name == leader.strip())
        raise AssertionError(f"no node leads queue {queue!r}")

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                try:
                    node.kill()
                except (OSError, ValueError, subprocess.TimeoutExpired):
                    node.process.kill()


def start_cluster(home: Path, size: int = 3) -> RabbitCluster:
    """``size`` nodes joined to the first; raises when one does not come up."""
    cookie = home / ".erlang.cookie"
    cookie.write_text(COOKIE)
    cookie.chmod(0o400)
    (home / "plugins").write_text("[].\n")
    cluster = RabbitCluster(home)
    tag = f"{os.getpid()}x{free_port()}"
    for i in range(size):
        node = RabbitNode(f"wmtest{tag}n{i}@localhost", free_port(), home)
        _launch(node)
        cluster.nodes.append(node)
    try:
        for node in cluster.nodes:
            _await_or_relaunch(cluster, node)
        for node in cluster.nodes[1:]:
            cluster.ctl(node, "stop_app")
            cluster.ctl(node, "join_cluster", cluster.nodes[0].name)
            cluster.ctl(node, "start_app")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _launch(node: RabbitNode) -> None:
    base = node.pid_file.parent
    base.mkdir(parents=True)
    env = {
        **os.environ,
        "HOME": str(node.home),
        "RABBITMQ_NODENAME": node.name,
        "RABBITMQ_NODE_PORT": str(node.port),
        "RABBITMQ_DIST_PORT": str(free_port()),
        "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
        "RABBITMQ_LOG_BASE": str(base / "log"),
        "RABBITMQ_PID_FILE": str(node.pid_file),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(node.home / "plugins"),
        "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq"),  # none: the defaults
    }
    with (base / "out.log").open("wb") as out:
        node.process = subprocess.Popen(
            [str(BIN / "rabbitmq-server")], env=env, stdout=out, stderr=subprocess.STDOUT
        )


class PortTaken(RuntimeError):
    """A node exited because another program bound one of its ports first."""


def _await_or_relaunch(cluster: RabbitCluster, node: RabbitNode, attempts: int = 3) -> None:
    """A port picked free can be taken before the node binds it (the kernel hands ports of
    its ephemeral range to outgoing connections too): such a node starts again, afresh, on
    new ports."""
    for attempt in range(1, attempts + 1):
        try:
            _await(cluster, node)
            return
        except PortTaken:
            if attempt == attempts:
                raise
            shutil.rmtree(node.pid_file.parent)
            node.port = free_port()
            _launch(node)


def _await(cluster: RabbitCluster, node: RabbitNode, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.process is not None and node.process.poll() is not None:
            log = (node.pid_file.parent / "out.log").read_text(errors="replace")
            taken = PortTaken if "eaddrinuse" in log else RuntimeError
            raise taken(f"RabbitMQ node {node.name} exited:\n{log[-2000:]}")
        if node.pid_file.exists():
            try:
                cluster.ctl(node, "await_startup", "--timeout", "5", timeout_s=15)
                return
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        time.sleep(0.5)
    raise RuntimeError(f"RabbitMQ node {node.name} did not start within {timeout_s:g} s")
