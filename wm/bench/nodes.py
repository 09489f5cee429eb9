"""Several bench nodes at once (``celery -A wm.bench.benchnode``, ``wm.bench.rig``), as the
scale and pool phases run them: launched together, told apart by their names
(``<prefix>@<host>.0``, ``.1``, …) and sharing the phase's exchanges and, on Redis, its ready
list; asked when they all answer a ping, what they consume, how they run and how much memory
they hold; stopped together.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from wm.bench.rig import Rig, size_pools
from wm.engine import resident_bytes

#: Seconds the nodes have to answer a ping and to consume every queue.
UP_TIMEOUT_S = 300.0
#: Seconds a control command's replies are collected.
CONTROL_TIMEOUT_S = 5.0


class Nodes:
    """``count`` bench nodes launched at once, one thread each holding :meth:`Rig.node`
    (Celery's ``pool`` of ``concurrency``); leaving stops them all (a warm shutdown each, in
    parallel)."""

    def __init__(
        self,
        rig: Rig,
        home: Path,
        count: int,
        concurrency: int,
        queue: str,
        pool: str = "prefork",
    ) -> None:
        self.rig, self.home, self.count = rig, home, count
        self.concurrency, self.queue, self.pool = concurrency, queue, pool
        self.names = [f"{rig.node_name}.{n}" for n in range(count)]
        self.pids: list[int] = []
        size_pools(rig.app, count)
        self.launched = 0.0
        self.up_s: float | None = None
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._hold, args=(n,), name=f"scale-node-{n}")
            for n in range(count)
        ]
        self._pinger = threading.Thread(target=self._ping, name="scale-ping", daemon=True)

    def __enter__(self) -> Nodes:
        self.launched = time.monotonic()
        for thread in self._threads:
            thread.start()
        self._pinger.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self.check()

    def _hold(self, n: int) -> None:
        home = self.home / f"scale-node{n}"
        home.mkdir(exist_ok=True)
        try:
            with self.rig.node(
                home, self.concurrency, [self.queue], name_suffix=f".{n}", pool=self.pool
            ) as node:
                self.pids.append(node.pid)
                self._stop.wait()
        except BaseException as exc:  # reported by the thread that waits for the nodes
            self.errors.append(exc)
            self._stop.set()

    def _ping(self) -> None:
        """Record when every node has answered a ping (seconds since the launch)."""
        answered: set[str] = set()
        deadline = self.launched + UP_TIMEOUT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            waiting = [name for name in self.names if name not in answered]
            replies = self.rig.app.control.ping(
                destination=waiting, timeout=0.5, limit=len(waiting)
            )
            for reply in replies or []:
                answered.update(reply)
            if answered >= set(self.names):
                self.up_s = time.monotonic() - self.launched
                return

    def check(self) -> None:
        """Raise if a node failed (exited, or did not answer in time)."""
        if self.errors:
            raise SystemExit(f"wm bench: a scale node failed: {self.errors[0]}")

    def wait_up(self) -> float:
        """Seconds from the launch until every node answered a ping."""
        self._pinger.join(UP_TIMEOUT_S)
        self.check()
        if self.up_s is None:
            raise SystemExit(f"wm bench: {self.count} scale nodes did not come up in time")
        return self.up_s

    def wait_consuming(self, queues: int) -> None:
        """Until every node consumes at least ``queues`` queues (its own and the workers')."""
        self.wait_up()
        deadline = time.monotonic() + UP_TIMEOUT_S
        while True:
            replies = self._inspect("active_queues")
            if all(len(replies.get(name) or []) >= queues for name in self.names):
                return
            self.check()
            if time.monotonic() > deadline:
                raise SystemExit(f"wm bench: the scale nodes did not consume {queues} queues")
            time.sleep(0.5)

    def describe(self) -> str:
        """How the nodes run (the first one's ``stats``; they are launched alike)."""
        stats = self._inspect("stats").get(self.names[0]) or {}
        pool = stats.get("pool", {})
        events = "on" if self.rig.settings.task_events else "off"
        return (
            f"nodes {', '.join(self.names)}: {pool.get('implementation')}, "
            f"{pool.get('max-concurrency')} processes, prefetch {stats.get('prefetch_count')}, "
            f"task events {events}"
        )

    def rss(self) -> list[int]:
        """Resident bytes of each node: its main process and its pool's processes."""
        stats = self._inspect("stats")
        sizes = []
        for name in self.names:
            node = stats.get(name)
            if node is None:
                raise SystemExit(f"wm bench: scale node {name} did not answer stats")
            pids = [int(node["pid"]), *map(int, node["pool"].get("processes", []))]
            sizes.append(sum(resident_bytes(pid) for pid in pids))
        return sizes

    def _inspect(self, method: str) -> dict[str, Any]:
        inspect = self.rig.app.control.inspect(
            destination=self.names, timeout=CONTROL_TIMEOUT_S, limit=self.count
        )
        return dict(getattr(inspect, method)() or {})
