"""The one child-process host and its frames (engines.childproc), on their own: a small child
speaking the protocol through the child's end of the pipes. The engines built on them (the
Python sandbox, native and .NET isolation) are tested in their own files."""

from __future__ import annotations

import fcntl
import logging
import os
import select
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engines.childproc import frames
from engines.childproc.host import ChildExited, ChildProcess, Launch
from engines.python import bootstrap
from tests.helpers import idle_cpu_s
from wm.errors import WorkerTimeout

#: A child answering each CALL: its payload back, or what the payload asks for.
CHILD = """
import sys, time
from engines.childproc import frames

channel = frames.Channel(int(sys.argv[2]), int(sys.argv[3]))
channel.spin(float(sys.argv[1]))
print("child up", flush=True)
while (frame := channel.receive()) is not None:
    kind, payload = frame
    if payload == b"log and gateway":
        channel.log(30, "from the child")
        code, answer = channel.call_gateway({"service": "s", "method": "m"}, b"ask")
        channel.send(frames.ANSWER, b"%d " % code + answer)
    elif payload == b"hang":
        time.sleep(60)
    elif payload == b"exit":
        sys.exit(3)
    else:
        channel.send(frames.ANSWER, payload)
"""


class Sinks:
    def __init__(self) -> None:
        self.logs: list[tuple[int, str]] = []
        self.calls: list[tuple[dict[str, Any], bytes]] = []

    def log(self, level: int, message: str) -> None:
        self.logs.append((level, message))

    def gateway(self, call: dict[str, Any], request: bytes, deadline: float) -> tuple[int, bytes]:
        assert deadline > time.monotonic()
        self.calls.append((call, request))
        return 7, b"answer"


@pytest.fixture
def sinks() -> Sinks:
    return Sinks()


#: Seconds each side polls for the other's frame (the default WM_ENGINE_SPIN_US's) or none.
SPINS = {"spinning": 1e-4, "asleep at once": 0.0}


@pytest.fixture(params=SPINS.values(), ids=SPINS.keys())
def child(sinks: Sinks, request: pytest.FixtureRequest) -> Iterator[ChildProcess]:
    spin_s = request.param
    printed: list[str] = []
    # the child's spin is its third argument here; an engine sends it with its INIT
    argv = (sys.executable, "-c", CHILD, str(spin_s))
    process = ChildProcess(
        Launch(argv, dict(os.environ), {}, output=printed.append, spin_s=spin_s), sinks
    )
    yield process
    process.close()


def soon(seconds: float = 10) -> float:
    return time.monotonic() + seconds


def test_a_frame_survives_any_chunking() -> None:
    stream = frames.encode(frames.CALL, b"x" * 1000) + frames.encode(frames.PROBE)
    buffer = frames.FrameBuffer()
    got = [frame for i in range(0, len(stream), 7) for frame in buffer.feed(stream[i : i + 7])]
    assert got == [(frames.CALL, b"x" * 1000), (frames.PROBE, b"")]


def test_reads_ask_for_what_a_pipe_holds_and_a_large_frame_crosses_whole(
    child: ChildProcess,
) -> None:
    """``os.read`` allocates what it asks for before it reads: a chunk past the pipe's
    capacity is never filled and cost 20 µs a read at 1 MiB. A frame of many chunks (5 MiB)
    still crosses both ways whole."""
    read_end, write_end = os.pipe()
    try:
        capacity = fcntl.fcntl(read_end, fcntl.F_GETPIPE_SZ)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert capacity >= frames.READ_CHUNK_BYTES
    payload = bytes(range(256)) * (20 * 1024)
    child.send(frames.CALL, payload, soon())
    assert child.receive(soon()) == (frames.ANSWER, payload)


def test_malformed_frames_are_frame_errors() -> None:
    too_large = frames.HEADER.pack(frames.CALL, frames.MAX_FRAME_BYTES + 1)
    with pytest.raises(frames.FrameError, match="over the"):
        frames.FrameBuffer().feed(too_large)
    with pytest.raises(frames.FrameError, match="header line"):
        frames.split_header(b"{}")
    with pytest.raises(frames.FrameError, match="not a JSON object"):
        frames.split_header(b"[1]\nblob")
    with pytest.raises(frames.FrameError, match="no 4-byte code"):
        frames.split_code(b"\x01")
    assert frames.split_header(frames.with_header({"a": 1}, b"x\ny")) == ({"a": 1}, b"x\ny")


def test_the_sandbox_bootstrap_reads_the_same_init_frame() -> None:
    """The bootstrap restates the header (it reads INIT before it can import frames)."""
    assert (bootstrap._HEADER.format, bootstrap._INIT) == (frames.HEADER.format, frames.INIT)


def test_log_and_gateway_frames_are_served_during_a_call(child: ChildProcess, sinks: Sinks) -> None:
    assert child.request(frames.CALL, b"echo", soon()) == (frames.ANSWER, b"echo")
    assert child.request(frames.CALL, b"log and gateway", soon()) == (frames.ANSWER, b"7 answer")
    assert sinks.logs == [(logging.WARNING, "from the child")]
    assert sinks.calls == [({"service": "s", "method": "m"}, b"ask")]
    assert child.output_tail[0] == "child up"


def test_a_call_past_its_deadline_times_out_and_close_reaps(child: ChildProcess) -> None:
    directory = child.directory
    assert directory is not None and os.path.isdir(directory)
    with pytest.raises(WorkerTimeout):
        child.request(frames.CALL, b"hang", soon(0.5))
    child.close()
    assert child.exited and not os.path.exists(f"/proc/{child.pid}")
    assert not os.path.exists(directory)
    child.close()  # idempotent


def test_a_child_that_ends_is_reported_with_its_status(child: ChildProcess) -> None:
    with pytest.raises(ChildExited) as ended:
        child.request(frames.CALL, b"exit", soon())
    assert (ended.value.pid, ended.value.returncode) == (child.pid, 3)


def test_a_graceful_close_lets_an_idle_child_finish(child: ChildProcess) -> None:
    child.request(frames.CALL, b"echo", soon())
    child.close(grace_s=5)
    assert child.returncode == 0  # it ended on its own, not killed


class CountingPoll:
    """A real ``select.poll`` that counts the polls that could not sleep (a spin's)."""

    def __init__(self, fd: int) -> None:
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self.spun = 0

    def poll(self, timeout_ms: int) -> list[tuple[int, int]]:
        self.spun += timeout_ms == 0
        return self._poll.poll(timeout_ms)


def test_a_spin_that_comes_to_nothing_skips_more_waits_each_time_and_one_that_catches_ends_it() -> (
    None
):
    read_end, write_end = os.pipe()
    try:
        poll = CountingPoll(read_end)
        spin = frames.Spin(1e-4)

        def spun(ready: bool) -> bool:
            before = poll.spun
            assert bool(spin.wait(poll, 1)) is ready  # type: ignore[arg-type]
            return poll.spun > before

        # after each spin that came to nothing, the next 1, 2, 4 … 64 waits sleep at once
        spun_in = [wait for wait in range(1, 200) if spun(False)]
        assert spun_in[:8] == [1, 3, 6, 11, 20, 37, 70, 135]
        os.write(write_end, b"x")
        while not spun(True):
            pass
        # the spin that caught the frame ended the row: 1, 2, 4 … again
        os.read(read_end, 1)
        assert [wait for wait in range(1, 12) if spun(False)] == [1, 3, 6, 11]
    finally:
        os.close(read_end)
        os.close(write_end)


def test_an_idle_spinning_child_sleeps(child: ChildProcess) -> None:
    """A child polls for the next call for at most its spin, then sleeps on the pipe: idle,
    it uses no CPU."""
    for _ in range(50):
        assert child.request(frames.CALL, b"echo", soon()) == (frames.ANSWER, b"echo")
    assert idle_cpu_s(child.pid) < 0.05
