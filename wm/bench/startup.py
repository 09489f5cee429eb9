"""The start-up phase of ``wm bench``: how long ``wm --help`` and ``wm worker list`` take.

Each command runs as a new process, the way a person or a script runs it, ``repeats`` times;
the median is reported with two baselines measured in the same run: an empty interpreter
(``python -c pass``), and the import of the libraries ``wm worker list`` cannot do without
(SQLAlchemy's ORM, redis-py and the database driver) -- the floor no lazy import can go below.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: What ``wm worker list`` needs whatever the command line does: the store and the health.
LIBRARY_FLOOR = "import sqlalchemy.orm, redis, sqlite3"
#: The issue's target for ``wm --help`` and ``wm worker list``, in seconds.
TARGET_S = 0.25


@dataclass(frozen=True)
class Timing:
    name: str
    median_s: float
    best_s: float

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "median_s": self.median_s, "best_s": self.best_s}


def _time(argv: Sequence[str], env: dict[str, str], repeats: int, name: str) -> Timing:
    """Run ``argv`` ``repeats`` times (after one unmeasured run that warms the file cache)."""
    subprocess.run(argv, env=env, capture_output=True, check=True)
    took = []
    for _ in range(repeats):
        began = time.perf_counter()
        subprocess.run(argv, env=env, capture_output=True, check=True)
        took.append(time.perf_counter() - began)
    return Timing(name, statistics.median(took), min(took))


def measure(repeats: int, redis_url: str) -> list[Timing]:
    """The start-up timings and their baselines; ``wm worker list`` reads an empty SQLite
    store (migrated first) and asks ``redis_url`` for health."""
    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="wm-startup-") as scratch:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("WM_")},
            "WM_DATABASE_URL": f"sqlite:///{Path(scratch) / 'wm.db'}",
            "WM_REDIS_URL": redis_url,
            "WM_BROKER_URL": redis_url,
        }
        subprocess.run(
            [python, "-m", "wm.cli", "db", "upgrade"], env=env, check=True, capture_output=True
        )
        return [
            _time([python, "-c", "pass"], env, repeats, "python -c pass"),
            _time([python, "-c", LIBRARY_FLOOR], env, repeats, "libraries of worker list"),
            _time([python, "-m", "wm.cli", "--help"], env, repeats, "wm --help"),
            _time([python, "-m", "wm.cli", "worker", "list"], env, repeats, "wm worker list"),
        ]


def report(repeats: int, redis_url: str) -> list[dict[str, object]]:
    """Measure, print the table (for people) and return the rows (for ``--json``)."""
    timings = measure(repeats, redis_url)
    floor = {t.name: t.median_s for t in timings}["libraries of worker list"]
    print(f"\nStart-up (median of {repeats} runs; target {TARGET_S} s):")
    print(f"{'command':<26} {'median s':>9} {'best s':>7} {'over the library floor':>23}")
    for t in timings:
        over = f"{t.median_s - floor:+.3f} s" if t.name == "wm worker list" else ""
        print(f"{t.name:<26} {t.median_s:>9.3f} {t.best_s:>7.3f} {over:>23}")
    return [t.to_json() for t in timings]
