"""The bench's pool phase on real nodes: every variant (prefork, threads, several nodes)
serves every queued event of both workloads, and the report shows each (small numbers:
this checks the tool and that each pool delivers, not the speed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wm import Settings
from wm.local import pools
from wm.local.rig import Rig
from wm.state.ledger import Ledger

EVENTS = 60


@pytest.mark.slow
def test_every_variant_serves_every_event_and_is_reported(
    pg_settings: Settings,
    own_redis: tuple[int, object],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = f"redis://127.0.0.1:{own_redis[0]}"
    settings = pg_settings.replace(broker_url=f"{server}/0", redis_url=f"{server}/1")
    with Rig(settings) as rig:
        results = pools.measure(rig, tmp_path, EVENTS, repeats=1)
        # a drain ends when the ledger is empty: every event of every run was served
        workers = [queue.rpartition("::")[2] for queue in rig.queues if "::" in queue]
        assert len(workers) == len(pools.WORKLOADS)
        assert all(Ledger(settings).pending(worker) == 0 for worker in workers)
        pools.report(results, EVENTS, 1, rig)
    out = capsys.readouterr().out
    assert [r.variant for r in results] == list(pools.VARIANTS)
    for result in results:
        assert all(len(result.rates[w]) == 1 and result.rate(w) > 0 for w in pools.WORKLOADS)
        assert result.rss and result.rss[0] > 0
        assert re.search(rf"^{re.escape(result.variant.name)}\s+\d+ \(\d+\) [\d.]+×", out, re.M)
    assert "celery.concurrency.thread:TaskPool" in out
    assert re.search(r"4 nodes x prefork 2: nodes (\S+@\S+\.\d, ){3}\S+@\S+\.3:", out)
