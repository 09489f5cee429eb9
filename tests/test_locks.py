"""Group locks against real Redis and real processes (DESIGN §6, the seed's lock lifecycle)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from itertools import pairwise
from multiprocessing.connection import Connection
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from tests.conftest import REDIS_HOST, STATE_DB
from wm.config import Settings
from wm.errors import BrokerUnavailable, FenceRejected, LockContention
from wm.state.ledger import Ledger
from wm.state.locks import GroupLocks, Lease, make_owner, retry_delay_ms
from wm.state.outcomes import Outcomes

SPAWN = multiprocessing.get_context("spawn")
GROUP = "group-a"
#: Acquisitions per process in the mutual-exclusion test (4 processes).
ROUNDS_PER_PROCESS = 130
#: Upper bound on waiting for a child process to report (s); a guard, not a timing assertion.
CHILD_TIMEOUT_S = 60.0


#: The suite's own state database (never the developer's WM_REDIS_URL); keys live under a
#: per-test prefix, so nothing is flushed.
REDIS_URL = f"{REDIS_HOST}/{STATE_DB}"


@pytest.fixture
def redis_url(redis_ok: None) -> str:
    """The suite's Redis; ``redis_ok`` skips when it is down, and fails in CI."""
    return REDIS_URL


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(redis_url, socket_connect_timeout=2)
    yield conn
    conn.close()


@pytest.fixture
def prefix(client: redis.Redis) -> Iterator[str]:
    """A key prefix no other test uses; every key under it is deleted afterwards."""
    unique = f"wm:test:{uuid.uuid4().hex}:lock:"
    yield unique
    keys = list(client.scan_iter(match=f"{unique}*"))
    if keys:
        client.delete(*keys)


def _settings(**changes: Any) -> Settings:
    fast = {
        "group_lock_retry_base_delay_ms": 5,
        "group_lock_lease_s": 5.0,
    }
    return Settings(redis_url=REDIS_URL).replace(**{**fast, **changes})


def _counting_client(url: str) -> tuple[redis.Redis, list[tuple[float, str]]]:
    """A client that records (monotonic time, command) for every write to its socket."""
    sent: list[tuple[float, str]] = []

    class CountingConnection(redis.Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            packed = b"".join(command) if isinstance(command, list) else bytes(command)
            sent.append((time.monotonic(), packed.split(b"\r\n")[2].decode().upper()))
            super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]

    pool = redis.ConnectionPool.from_url(url, connection_class=CountingConnection)
    return redis.Redis(connection_pool=pool), sent


def _server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _wait_until_expired(client: redis.Redis, locks: GroupLocks, group: str = GROUP) -> float:
    """Wait until the lock's lease has run out on the Redis clock; returns the wait (s)."""
    started = time.monotonic()
    while locks.holder(group) is not None:
        assert time.monotonic() - started < CHILD_TIMEOUT_S, "the lease never expired"
        time.sleep(0.005)
    return time.monotonic() - started


def _receive(conn: Connection) -> Any:
    assert conn.poll(CHILD_TIMEOUT_S), "child process did not report in time"
    message = conn.recv()
    assert message[0] != "error", message[1]
    return message


def _wait_stopped(pid: int) -> None:
    """Block until the kernel reports the process as stopped (state T)."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rpartition(")")[2].split()[0] == "T":
                return
        time.sleep(0.005)
    pytest.fail(f"process {pid} did not stop")


# --- child processes (module level so that "spawn" can import them) ---------------------


def _contend(
    url: str, prefix: str, barrier: Any, results: Any
) -> None:  # pragma: no cover - runs in a child
    try:
        settings = _settings(group_lock_retry_base_delay_ms=5)
        locks = GroupLocks(client=redis.Redis.from_url(url), settings=settings, prefix=prefix)
        intervals = []
        barrier.wait(timeout=CHILD_TIMEOUT_S)
        for index in range(ROUNDS_PER_PROCESS):
            lease = locks.acquire(GROUP, make_owner(f"round-{index}"), retries=12)
            enter_ns = time.time_ns()
            locks.mark_write(lease)
            time.sleep(0.0002)
            exit_ns = time.time_ns()
            if not locks.release(lease):
                raise AssertionError(f"release refused for {lease}")
            intervals.append((enter_ns, exit_ns, lease.fence))
        results.put(("ok", intervals))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def _live_holder(
    url: str, prefix: str, lease_s: float, write_first: bool, conn: Connection
) -> None:  # pragma: no cover - runs in a child
    """Holds the lock with a heartbeat (as a delivery does) until the parent stops, kills or
    resumes it; then tries a late write."""
    try:
        settings = _settings(group_lock_lease_s=lease_s)
        locks = GroupLocks(client=redis.Redis.from_url(url), settings=settings, prefix=prefix)
        lease = locks.acquire(GROUP, make_owner("paused"))
        with locks.keep_alive(lease, limit_s=CHILD_TIMEOUT_S):
            if write_first:
                locks.mark_write(lease)
            conn.send(("held", lease))
            conn.recv()  # the parent says "publish" once this process runs again
            try:
                locks.mark_write(lease)
                late_publish = "accepted"
            except FenceRejected as exc:
                late_publish = f"refused: {exc}"
        conn.send(("done", late_publish, locks.release(lease)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# --- tests ---------------------------------------------------------------------------------


def test_uncontended_acquire_and_release_take_two_round_trips(redis_url: str, prefix: str) -> None:
    counting, sent = _counting_client(redis_url)
    locks = GroupLocks(client=counting, settings=_settings(), prefix=prefix)
    warm_up = locks.acquire(GROUP, "warm-up")  # connects and loads each script once
    locks.mark_write(warm_up)
    locks.release(warm_up)
    sent.clear()

    assert locks.release(locks.acquire(GROUP, "owner-1"))
    assert [command for _, command in sent] == ["EVALSHA", "EVALSHA"]

    sent.clear()
    locks.mark_write(locks.acquire(GROUP, "owner-2"))
    assert [command for _, command in sent] == ["EVALSHA", "EVALSHA"]
    counting.close()


@pytest.mark.slow
def test_four_processes_never_overlap_and_fences_follow_entry_order(
    redis_url: str, prefix: str
) -> None:
    barrier = SPAWN.Barrier(4)
    results = SPAWN.Queue()
    processes = [
        SPAWN.Process(target=_contend, args=(redis_url, prefix, barrier, results)) for _ in range(4)
    ]
    for process in processes:
        process.start()
    try:
        reports = [results.get(timeout=CHILD_TIMEOUT_S) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=CHILD_TIMEOUT_S)
            if process.is_alive():
                process.kill()
    errors = [report[1] for report in reports if report[0] != "ok"]
    assert not errors, errors[0]

    intervals = sorted(interval for report in reports for interval in report[1])
    assert len(intervals) == 4 * ROUNDS_PER_PROCESS
    for before, after in pairwise(intervals):
        assert before[1] < after[0], f"critical sections overlap: {before} and {after}"
        assert before[2] < after[2], f"fence went backwards: {before} then {after}"


def test_fences_increase_across_release_expiry_and_takeover(
    client: redis.Redis, prefix: str
) -> None:
    locks = GroupLocks(client=client, settings=_settings(group_lock_lease_s=0.1), prefix=prefix)
    first = locks.acquire(GROUP, "a")
    assert locks.release(first)
    second = locks.acquire(GROUP, "b")
    assert locks.try_acquire(GROUP, "c") is None  # held while its lease runs
    _wait_until_expired(client, locks)
    taken_over = locks.try_acquire(GROUP, "c")
    assert taken_over is not None
    client.delete(f"{prefix}{{{GROUP}}}")  # deleted by hand
    after_delete = locks.acquire(GROUP, "d")

    fences = [first.fence, second.fence, taken_over.fence, after_delete.fence]
    assert fences == sorted(set(fences)), fences
    holder = locks.holder(GROUP)
    assert holder is not None
    assert (holder["owner"], holder["fence"], holder["written"]) == ("d", after_delete.fence, False)
    assert holder["acquired_at_ms"] == after_delete.acquired_at_ms
    assert 0 < holder["lease_left_ms"] <= 100


def test_a_lock_taken_after_its_holder_lease_expired_names_that_holder(
    client: redis.Redis, prefix: str
) -> None:
    """The acquire script sees a holder that never released (its ``…:last`` key); a lock
    released, retaken by its own holder, or never taken is no steal. Fences are untouched."""
    locks = GroupLocks(client=client, settings=_settings(group_lock_lease_s=0.1), prefix=prefix)
    first = locks.acquire(GROUP, "a")
    assert first.stolen_from is None
    assert locks.acquire(GROUP, "a").stolen_from is None  # the same owner again
    assert locks.release(first)
    second = locks.acquire(GROUP, "b")
    assert second.stolen_from is None  # a released lock is no steal
    _wait_until_expired(client, locks)
    stolen = locks.try_acquire(GROUP, "c")
    assert stolen is not None and stolen.stolen_from == ("b", second.fence)
    assert stolen.fence == second.fence + 1
    assert not locks.release(second)  # too late: the new holder stays recorded
    assert locks.release(stolen)
    assert locks.acquire(GROUP, "d").stolen_from is None
    item = locks.take_reading(GROUP, "e", None, item="x")[0]
    while client.exists(f"{prefix}{{{GROUP}}}:item:x"):  # its lease runs out
        time.sleep(0.005)
    taken = locks.take_reading(GROUP, "f", None, item="x")[0]
    assert taken.stolen_from == ("e", item.fence)
    assert locks.release(taken)
    assert not client.exists(f"{prefix}{{{GROUP}}}:item:x:last")


@pytest.mark.parametrize("holder_wrote", [True, False], ids=["wrote", "did-not-write"])
def test_a_paused_holder_loses_its_lock_after_one_lease_and_its_late_write_is_refused(
    client: redis.Redis, redis_url: str, prefix: str, holder_wrote: bool
) -> None:
    """SIGSTOP stops the heartbeat with the holder: its lease runs out whether or not it has
    written, a contender takes over under a higher fence, and the resumed holder's next write
    and its release are refused (the fence decides, not the holder's belief)."""
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("needs /proc to see that the holder is stopped")
    lease_s = 0.5
    ours, theirs = SPAWN.Pipe()
    child = SPAWN.Process(
        target=_live_holder, args=(redis_url, prefix, lease_s, holder_wrote, theirs)
    )
    child.start()
    try:
        _, paused = _receive(ours)
        assert child.pid is not None
        os.kill(child.pid, signal.SIGSTOP)
        _wait_stopped(child.pid)
        contender = GroupLocks(
            client=client, settings=_settings(group_lock_lease_s=lease_s), prefix=prefix
        )
        _wait_until_expired(client, contender)
        taken_over = contender.try_acquire(GROUP, "contender")
        os.kill(child.pid, signal.SIGCONT)
        ours.send("publish")
        _, late_publish, released = _receive(ours)
    finally:
        if child.is_alive():
            child.kill()
        child.join()
    assert taken_over is not None and taken_over.fence > paused.fence
    assert late_publish.startswith("refused:") and f"fence {paused.fence}" in late_publish
    assert "'contender'" in late_publish
    assert released is False
    holder = contender.holder(GROUP)
    assert holder is not None and (holder["owner"], holder["fence"]) == (
        "contender",
        taken_over.fence,
    )


@pytest.mark.slow
def test_a_killed_holder_frees_its_group_within_one_lease(
    client: redis.Redis, redis_url: str, prefix: str
) -> None:
    """kill -9 of a holder that renews its lease and has written: the lock is free again at
    most one lease after the kill (the last renewal was at most a third of a lease earlier)."""
    lease_s = 0.6
    ours, theirs = SPAWN.Pipe()
    child = SPAWN.Process(target=_live_holder, args=(redis_url, prefix, lease_s, True, theirs))
    child.start()
    try:
        _, killed = _receive(ours)
        time.sleep(2 * lease_s)  # the heartbeat keeps it held across several leases
        contender = GroupLocks(
            client=client, settings=_settings(group_lock_lease_s=lease_s), prefix=prefix
        )
        assert contender.try_acquire(GROUP, "contender") is None
        child.kill()
        child.join()
        # On the Redis clock, which the test's own scheduling under load does not stretch:
        # what is left of the lease once the holder is dead.
        held = contender.holder(GROUP)
        left_ms = held["lease_left_ms"] if held is not None else 0
        _wait_until_expired(client, contender)
    finally:
        if child.is_alive():
            child.kill()
        child.join()
    taken_over = contender.try_acquire(GROUP, "contender")
    assert taken_over is not None and taken_over.fence > killed.fence
    assert left_ms <= lease_s * 1000, left_ms


def test_a_heartbeat_keeps_a_live_holder_until_its_limit(client: redis.Redis, prefix: str) -> None:
    lease_s, limit_s = 0.3, 1.2
    locks = GroupLocks(client=client, settings=_settings(group_lock_lease_s=lease_s), prefix=prefix)
    lease = locks.acquire(GROUP, "holder")
    started = time.monotonic()
    with locks.keep_alive(lease, limit_s=limit_s) as heartbeat:
        while time.monotonic() - started < limit_s - lease_s:
            assert locks.try_acquire(GROUP, "contender") is None
            time.sleep(0.02)
        locks.mark_write(lease)  # still the holder, several leases after taking the lock
        _wait_until_expired(client, locks)  # renewal stops at the limit
        freed_at_s = time.monotonic() - started
    assert heartbeat.renewals >= 3 and not heartbeat.lost
    assert limit_s <= freed_at_s <= limit_s + lease_s + 0.5, freed_at_s
    with pytest.raises(FenceRejected, match="lock is free"):
        locks.mark_write(lease)
    assert locks.release(lease) is False


def test_heartbeats_of_one_process_are_renewed_together_and_stop_at_exit(
    client: redis.Redis, prefix: str
) -> None:
    """The process's one renewer keeps several leases (a threads pool holds several at
    once), one entered later than the other, and renews none after its heartbeat ended."""
    lease_s = 0.3
    locks = GroupLocks(client=client, settings=_settings(group_lock_lease_s=lease_s), prefix=prefix)
    first, second = locks.acquire("a", "holder"), locks.acquire("b", "holder")
    with locks.keep_alive(first, limit_s=10) as beat_a:
        time.sleep(lease_s / 2)
        with locks.keep_alive(second, limit_s=10) as beat_b:
            time.sleep(3 * lease_s)
            assert locks.holder("a") is not None and locks.holder("b") is not None
        renewals_b = beat_b.renewals
        time.sleep(2 * lease_s)
        assert locks.holder("b") is None  # not renewed after its heartbeat ended
        assert locks.holder("a") is not None
    assert beat_a.renewals >= 6 and renewals_b >= 3 and beat_b.renewals == renewals_b
    assert not beat_a.lost and not beat_b.lost


def test_renewing_a_lost_lease_fails_and_leaves_the_new_holder_alone(
    client: redis.Redis, prefix: str
) -> None:
    short = GroupLocks(client=client, settings=_settings(group_lock_lease_s=0.1), prefix=prefix)
    long = GroupLocks(client=client, settings=_settings(group_lock_lease_s=2.0), prefix=prefix)
    record = f"{prefix}{{{GROUP}}}"
    old = short.acquire(GROUP, "old")
    _wait_until_expired(client, short)
    assert long.renew(old) is False
    new = long.acquire(GROUP, "new")
    client.pexpire(record, 1000)
    assert long.renew(old) is False
    assert 0 < client.pttl(record) <= 1000  # untouched by the stale renewal
    assert long.renew(new) is True
    assert 1000 < client.pttl(record) <= 2000


def test_contention_backs_off_exponentially_then_names_the_holder(
    client: redis.Redis, redis_url: str, prefix: str
) -> None:
    holder = GroupLocks(client=client, settings=_settings(), prefix=prefix).acquire(GROUP, "holder")
    counting, sent = _counting_client(redis_url)
    base_ms, retries = 20, 3
    contender = GroupLocks(
        client=counting,
        settings=_settings(group_lock_retry_base_delay_ms=base_ms),
        prefix=prefix,
    )

    with pytest.raises(LockContention) as refused:
        contender.acquire(GROUP, "contender", retries=retries)

    attempts = [at for at, command in sent if command == "EVALSHA"]
    assert len(attempts) == retries + 1
    for retry, (earlier, later) in enumerate(pairwise(attempts)):
        assert later - earlier >= base_ms * 2**retry / 1000
    message = str(refused.value)
    assert f"{GROUP!r}" in message and "'holder'" in message and f"fence {holder.fence}" in message
    assert f"{retries + 1} attempts" in message
    counting.close()


def test_non_owner_and_stale_fence_cannot_release_or_write(
    client: redis.Redis, prefix: str
) -> None:
    locks = GroupLocks(client=client, settings=_settings(), prefix=prefix)
    lease = locks.acquire(GROUP, "owner")
    forgeries = [
        Lease(GROUP, "intruder", lease.fence, lease.acquired_at_ms),
        Lease(GROUP, "owner", lease.fence - 1, lease.acquired_at_ms),
        Lease(GROUP, "owner", lease.fence + 1, lease.acquired_at_ms),
    ]
    for forged in forgeries:
        assert locks.release(forged) is False
        with pytest.raises(FenceRejected, match=f"held by 'owner' \\(fence {lease.fence}\\)"):
            locks.mark_write(forged)

    holder = locks.holder(GROUP)
    assert holder is not None and (holder["owner"], holder["fence"]) == ("owner", lease.fence)
    assert holder["written"] is False
    assert locks.release(lease) is True
    assert locks.holder(GROUP) is None


def test_an_outcome_record_checks_the_fence_in_its_script_and_a_taker_reads_it(
    client: redis.Redis, prefix: str
) -> None:
    """A record carrying a lost lease's fence writes nothing (no outcome, the pending entry
    kept); one under the live lease is written and marks the lock written; the next taker
    reads it as it takes the lock."""
    settings = _settings()
    locks = GroupLocks(client=client, settings=settings, prefix=prefix)
    outcomes, ledger = Outcomes(settings), Ledger(settings)
    worker, key = f"{prefix}worker", uuid.uuid4().hex
    ledger.add([(worker, "q")], key, "payload")
    lease = locks.acquire(GROUP, "owner")
    stale = Lease(GROUP, "owner", lease.fence - 1, lease.acquired_at_ms)
    for lost in (stale, Lease(GROUP, "intruder", lease.fence, lease.acquired_at_ms)):
        fence = locks.write_fence(lost)
        assert fence is not None
        with pytest.raises(FenceRejected, match=f"held by 'owner' \\(fence {lease.fence}\\)"):
            outcomes.record(worker, key, [], ledger.settlement(worker, key, "payload"), None, fence)
        assert client.exists(Outcomes.key(worker, key)) == 0
        assert ledger.pending(worker) == 1
    outcomes.record(
        worker, key, [], ledger.settlement(worker, key, "payload"), None, locks.write_fence(lease)
    )
    assert ledger.pending(worker) == 0
    holder = locks.holder(GROUP)
    assert holder is not None and holder["written"] is True
    locks.release(lease)
    taken, recorded = locks.take_reading(GROUP, "next", Outcomes.key(worker, key))
    assert taken.fence == lease.fence + 1 and outcomes.parse(recorded) == []
    locks.release(taken)
    client.delete(Outcomes.key(worker, key))


def test_held_lock_is_not_taken_and_retaking_own_lock_is_idempotent(
    client: redis.Redis, prefix: str
) -> None:
    locks = GroupLocks(client=client, settings=_settings(), prefix=prefix)
    lease = locks.acquire(GROUP, "owner")
    assert locks.try_acquire(GROUP, "other") is None
    assert locks.try_acquire(GROUP, "owner") == lease


def test_the_record_lives_one_lease_writes_renew_it_and_keys_share_a_slot(
    client: redis.Redis, prefix: str
) -> None:
    locks = GroupLocks(client=client, settings=_settings(group_lock_lease_s=2.0), prefix=prefix)
    lease = locks.acquire(GROUP, "owner")
    record, fence = f"{prefix}{{{GROUP}}}", f"{prefix}{{{GROUP}}}:fence"
    assert 1500 < client.pttl(record) <= 2000
    client.pexpire(record, 500)
    locks.mark_write(lease)
    assert 1500 < client.pttl(record) <= 2000
    assert client.pttl(fence) == -1  # the fence counter must never reset
    assert key_slot(record.encode()) == key_slot(fence.encode())


def test_retry_delays_double_and_never_exceed_half_a_lease() -> None:
    settings = _settings(group_lock_retry_base_delay_ms=100, group_lock_lease_s=5.0)
    assert [retry_delay_ms(settings, n) for n in range(7)] == [100, 200, 400, 800, 1600, 2500, 2500]
    assert retry_delay_ms(settings, 10**6) == 2500  # a delivery may wait thousands of times
    short = settings.replace(group_lock_lease_s=0.5)
    assert [retry_delay_ms(short, n) for n in range(4)] == [100, 200, 250, 250]
    assert retry_delay_ms(settings.replace(group_lock_lease_s=0.0), 0) == 50  # lease floor 100 ms


def test_holding_releases_when_the_block_fails(client: redis.Redis, prefix: str) -> None:
    locks = GroupLocks(client=client, settings=_settings(), prefix=prefix)
    with pytest.raises(RuntimeError), locks.holding(GROUP, "owner") as lease:
        assert locks.holder(GROUP) is not None and lease.owner == "owner"
        raise RuntimeError("worker code failed")
    assert locks.holder(GROUP) is None


def test_works_with_a_client_that_decodes_responses(redis_url: str, prefix: str) -> None:
    decoding = redis.Redis.from_url(redis_url, decode_responses=True)
    locks = GroupLocks(client=decoding, settings=_settings(), prefix=prefix)
    lease = locks.acquire(GROUP, "owner")
    locks.mark_write(lease)
    holder = locks.holder(GROUP)
    assert holder is not None and holder["written"] is True and holder["fence"] == lease.fence
    assert locks.release(lease)
    decoding.close()


def test_unreachable_redis_is_reported_with_the_setting_to_fix() -> None:
    # Bound but not listening: connections to the port are refused for as long as the probe
    # holds it, and no other program can take it meanwhile.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        unreachable = redis.Redis(
            host="127.0.0.1", port=port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
        )
        locks = GroupLocks(_settings(redis_url=f"redis://127.0.0.1:{port}/0"), client=unreachable)
        with pytest.raises(BrokerUnavailable) as refused:
            locks.try_acquire(GROUP, "owner")
        assert f"127.0.0.1:{port}" in str(refused.value) and "WM_REDIS_URL" in str(refused.value)
        with pytest.raises(BrokerUnavailable):
            locks.holder(GROUP)
        unreachable.close()


def test_a_release_wakes_a_waiting_contender_before_its_backoff_ends(
    client: redis.Redis, prefix: str
) -> None:
    """A contender in a long backoff takes the lock as soon as the holder releases it."""
    settings = _settings(group_lock_retry_base_delay_ms=2000)
    holder = GroupLocks(client=client, settings=settings, prefix=prefix)
    lease = holder.acquire("g", "holder")
    timer = threading.Timer(0.2, holder.release, args=(lease,))
    timer.start()
    started = time.monotonic()
    contender = GroupLocks(client=client, settings=settings, prefix=prefix)
    taken = contender.acquire("g", "contender", retries=1)
    waited = time.monotonic() - started
    timer.join()
    assert taken.owner == "contender" and taken.fence > lease.fence
    assert 0.2 <= waited < 1.5  # woken by the release, long before the 2 s backoff


@pytest.mark.parametrize("released_after_s", [0.05, None], ids=["within", "never"])
def test_take_waits_only_its_hand_off_window(
    client: redis.Redis, prefix: str, released_after_s: float | None
) -> None:
    """What a delivery does: take a lock released within the hand-off window at once, else
    give up after the window (not after backoffs) so the delivery can wait in the broker."""
    settings = _settings(group_lock_handoff_ms=300, group_lock_retry_base_delay_ms=5000)
    locks = GroupLocks(client=client, settings=settings, prefix=prefix)
    lease = locks.acquire("g", "holder")
    timer = threading.Timer(released_after_s or 0, locks.release, args=(lease,))
    if released_after_s is not None:
        timer.start()
    started = time.monotonic()
    try:
        taken: Lease | None = locks.take("g", "contender")
    except LockContention as exc:
        assert "'holder'" in str(exc) and "lease left" in str(exc)
        taken = None
    waited = time.monotonic() - started
    if released_after_s is not None:
        timer.join()
        assert taken is not None and taken.fence > lease.fence
        assert released_after_s <= waited < 0.3
    else:
        assert taken is None
        assert 0.3 <= waited < 1.0


def test_the_hand_off_window_is_at_most_a_quarter_lease() -> None:
    settings = _settings(group_lock_handoff_ms=5000, group_lock_lease_s=2.0)
    assert GroupLocks(settings).handoff_ms == 500
    assert GroupLocks(settings.replace(group_lock_handoff_ms=0)).handoff_ms == 0
