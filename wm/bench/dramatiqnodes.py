"""The drain's second reference: a plain Dramatiq node (``wm/bench/plain/plaindramatiq``),
its own ``dramatiq`` process tree with only that folder on its import path, on the bench's
Redis broker: ``--processes`` as the other sides' pools, Dramatiq's default 8 threads each,
and a prefetch of 32 per process (the issue's measurement).

Dramatiq has no command that stops a node consuming, so a drain's queue is filled aside:
while paused, each message's body goes to the queue's hash and its id to a list the node
does not read; resuming renames that list to the queue's (one atomic command).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import TracebackType

from wm.bench.plainnodes import PLAIN_DIR, STOP_TIMEOUT_S, UP_TIMEOUT_S, spawn
from wm.state.connection import pooled_client

#: What the node's module (``plaindramatiq``, which imports nothing of wm and so cannot
#: import these) reads from its environment, and the name of its actor.
BROKER_ENV, NAMESPACE_ENV, QUEUE_ENV = (
    "PLAIN_DRAMATIQ_BROKER_URL",
    "PLAIN_DRAMATIQ_NAMESPACE",
    "PLAIN_DRAMATIQ_QUEUE",
)
NOOP = "noop"
#: The row's name in the drain's table.
DRAMATIQ = "plain dramatiq"
#: Dramatiq's threads per process (its default) and messages prefetched per process.
THREADS, PREFETCH = 8, 32


class DramatiqNode:
    """One Dramatiq node of ``processes`` processes draining one queue; leaving stops it."""

    def __init__(self, broker_url: str, prefix: str, home: Path, processes: int) -> None:
        self.broker_url, self.home, self.processes = broker_url, home, processes
        self.namespace, self.queue = f"{prefix}-dramatiq", "drain"
        self.client = pooled_client(broker_url)
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.key = f"{self.namespace}:{self.queue}"
        self.messages, self.aside = f"{self.key}.msgs", f"{self.key}.aside"

    def __enter__(self) -> DramatiqNode:
        try:
            self.process = self._launch()
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
        return [self.process.pid] if self.process else []

    def _launch(self) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "dramatiq", "plaindramatiq", "--path", str(PLAIN_DIR)]
        command += ["--processes", str(self.processes), "--threads", str(THREADS)]
        command += ["--skip-logging", "--worker-shutdown-timeout", "10000"]
        variables = {
            "dramatiq_queue_prefetch": str(PREFETCH),
            BROKER_ENV: self.broker_url,
            NAMESPACE_ENV: self.namespace,
            QUEUE_ENV: self.queue,
        }
        return spawn(command, self.home / "plain-dramatiq", variables)

    def _wait_up(self) -> None:
        """Until every process has fetched once (each writes its heartbeat then)."""
        deadline = time.monotonic() + UP_TIMEOUT_S
        while self.client.zcard(f"{self.namespace}:__heartbeats__") < self.processes:
            assert self.process is not None
            if self.process.poll() is not None:
                raise SystemExit(
                    f"wm bench: the Dramatiq node exited with {self.process.returncode}; "
                    f"its log: {self.home}/plain-dramatiq/node.log"
                )
            if time.monotonic() > deadline:
                raise SystemExit("wm bench: the Dramatiq node did not come up")
            time.sleep(0.1)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        """Hand what was filled aside to the node (its queue is empty between drains)."""
        if self.client.exists(self.aside):
            self.client.rename(self.aside, self.key)
        self.paused = False

    def fill(self, count: int) -> None:
        """``count`` messages of the no-op actor, as Dramatiq's ``enqueue`` writes them."""
        from dramatiq import Message

        target = self.aside if self.paused else self.key
        pipe = self.client.pipeline(transaction=False)
        for _ in range(count):
            redis_id = str(uuid.uuid4())
            message: Message[None] = Message(
                queue_name=self.queue, actor_name=NOOP, args=(), kwargs={},
                options={"redis_message_id": redis_id},
            )  # fmt: skip
            pipe.hset(self.messages, redis_id, message.encode())
            pipe.rpush(target, redis_id)
        pipe.execute()

    def left(self, queue: str) -> int:
        """Messages not yet acknowledged (Dramatiq deletes a message's body at its ack)."""
        return int(self.client.hlen(self.messages))

    def describe(self) -> str:
        return (
            f"plain dramatiq: {self.processes} processes × {THREADS} threads, prefetch "
            f"{PREFETCH} per process, Redis broker, log level WARNING, its module imports "
            "nothing of wm"
        )

    def close(self) -> None:
        """A warm shutdown, a kill if it lingers, and the node's keys deleted."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        keys = list(self.client.scan_iter(match=f"{self.namespace}:*", count=1000))
        if keys:
            self.client.delete(*keys)


class DramatiqProbe:
    """What is left of a drain on the Dramatiq node: its unacknowledged messages."""

    poll_commands = 1

    def __init__(self, node: DramatiqNode) -> None:
        self.node = node

    def mark(self) -> None:
        """Nothing to remember: the queue's hash tells the end."""

    def left(self, queue: str) -> int:
        return self.node.left(queue)

    def done(self, queue: str, events: int, left: int) -> bool:
        return not left
