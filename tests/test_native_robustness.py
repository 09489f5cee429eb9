"""The native kit under attack: malformed inputs to the example libraries (in a child
process, so a crash fails the test instead of ending pytest), the misbehave library's
refusals and accounting, and the C answers against the official FlatBuffers verifier."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

from tests.native.harness import (
    CDEF,
    HERE,
    INVALID_INPUT,
    KIT,
    OK,
    Answer,
    Host,
    Library,
    Wire,
    ffi,
    run,
)

# --- inputs and answers that could crash: in a child process ------------------------------------

#: Calls Process of library argv[2] on each input of the JSON file argv[3] (hex strings) and
#: prints the codes. Each input is passed twice: right after a PROT_NONE page, then right before
#: one, so that reading outside it is a segfault, not an unnoticed read.
CHILD = HERE / "guarded_calls.py"


def _in_child(
    library: Path, cases: list[bytes], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps([case.hex() for case in cases]))
    cmd = [sys.executable, str(CHILD), CDEF, str(library), str(cases_file)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)


def _codes(result: subprocess.CompletedProcess[str]) -> list[int]:
    """The code of each case, the same at both addresses."""
    if result.returncode < 0:
        raise AssertionError(f"the child died of {signal.Signals(-result.returncode).name}")
    assert result.returncode == 0, result.stderr
    codes = json.loads(result.stdout)
    assert codes[0::2] == codes[1::2], "an input was answered differently at another address"
    return list(codes[0::2])


#: What a noise byte is drawn from, mostly: small offsets and lengths reach deeper than uniform
#: bytes, whose 32-bit offsets almost always point outside the buffer.
NOISE_BYTES = (0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 0x80, 0xFC, 0xFF)


def _noise(rng: random.Random) -> bytes:
    return bytes(
        rng.choice(NOISE_BYTES) if rng.random() < 0.8 else rng.randrange(256)
        for _ in range(rng.randrange(300))
    )


def _retarget(buf: bytes, rng: random.Random) -> bytes:
    """buf with a tail of noise and one of its words made to point into the tail, as an offset
    (forward) or as a table's offset to its vtable (backward): reads near the end."""
    tail = bytes(rng.choice(NOISE_BYTES) for _ in range(rng.randrange(1, 24)))
    out = bytearray(buf + tail)
    root = int.from_bytes(buf[:4], "little")  # whose first word locates its vtable
    word = root if rng.random() < 0.25 else 4 * rng.randrange(len(buf) // 4)
    target = len(buf) + rng.randrange(len(tail))
    value = target - word if rng.random() < 0.5 else word - target
    out[word : word + 4] = (value & 0xFFFFFFFF).to_bytes(4, "little")
    return bytes(out)


def _mutate(buf: bytes, rng: random.Random) -> bytes:
    out = bytearray(buf)
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def test_malformed_input_is_refused_without_reading_outside_it(
    library_paths: dict[str, Path], wire: Wire, rng: random.Random, tmp_path: Path
) -> None:
    """The C example (virtufin_flatbuf.h) and the C++ one (the official verifier) on truncated,
    random and corrupted inputs: neither crashes, and they accept exactly the same inputs."""
    valid = wire.encode({"correlationid": "c-1", "traceparent": "00-ab"}, data=b"some data")
    # Every byte up to the last non-zero one is checked; the zeros after it may be padding.
    significant = len(valid.rstrip(b"\0"))
    noise = [_noise(rng) for _ in range(500)]
    mutated = [_mutate(valid, rng) for _ in range(300)] + [
        _retarget(valid, rng) for _ in range(500)
    ]
    cases = [valid, *(valid[:n] for n in range(len(valid))), *noise, *mutated]
    verdicts = {}
    for name in ("c_example", "cpp_example"):
        codes = _codes(_in_child(library_paths[name], cases, tmp_path))
        truncated, rest = codes[1 : 1 + len(valid)], codes[1 + len(valid) :]
        assert codes[0] == OK, name
        assert set(truncated[:significant]) == {INVALID_INPUT}, f"{name} accepted a cut input"
        assert set(rest[: len(noise)]) == {INVALID_INPUT}, f"{name} accepted noise"
        assert set(codes) <= {OK, INVALID_INPUT}, name
        verdicts[name] = codes
    differ = [
        case.hex() for case, c, cpp in zip(cases, *verdicts.values(), strict=True) if c != cpp
    ]
    assert not differ, f"the C and C++ verdicts differ on {len(differ)} inputs, e.g. {differ[0]}"


def test_misbehave_crash_is_a_segfault(
    library_paths: dict[str, Path], wire: Wire, tmp_path: Path
) -> None:
    result = _in_child(library_paths["misbehave"], [wire.encode(subject="crash")], tmp_path)
    assert result.returncode == -signal.SIGSEGV, result.stderr


# --- misbehave, in process: the refusals it provokes, and its accounting -------------------------


def test_misbehave_answers_what_the_host_must_refuse(
    libraries: dict[str, Library], wire: Wire, host: Host
) -> None:
    misbehave = libraries["misbehave"]
    raw: dict[str, tuple[int, bool, int]] = {}
    answers: dict[str, Answer] = {}
    for subject in ("garbage", "null", "negative", "huge", "both", "neither"):
        rc, out, size = misbehave.process(host, wire.encode(subject=subject))
        raw[subject] = (rc, out == ffi.NULL, size)
        if subject in ("both", "neither"):
            answers[subject] = wire.decode(bytes(ffi.buffer(out, size)))
        if out != ffi.NULL:
            misbehave.lib.FreeResult(out)
    assert raw["garbage"] == (OK, False, 64)
    assert raw["null"] == (OK, True, 0)
    assert raw["negative"] == (OK, False, -5)
    assert raw["huge"] == (OK, False, 0x7FFFFFFF)
    assert answers["both"].error == "asked for both" and answers["both"].event is not None
    assert answers["neither"] == Answer(None, None)
    assert misbehave.lib.OutstandingResults() == 0


def test_misbehave_counts_results_not_freed_and_freed_twice(
    libraries: dict[str, Library], wire: Wire, host: Host
) -> None:
    misbehave = libraries["misbehave"].lib
    freed_twice = misbehave.FreedTwice()
    rc, out, size = libraries["misbehave"].process(host, wire.encode(data=b"echo"))
    assert rc == OK
    event = wire.decode(bytes(ffi.buffer(out, size))).event
    assert event is not None and event["data"] == b"ECHO"
    assert misbehave.OutstandingResults() == 1
    misbehave.FreeResult(out)
    assert misbehave.OutstandingResults() == 0
    misbehave.FreeResult(out)
    assert (misbehave.OutstandingResults(), misbehave.FreedTwice()) == (0, freed_twice + 1)


# --- the answers of virtufin_flatbuf.h against the official C++ verifier -------------------------

VERIFIER = HERE / "verify_answers.cpp"


def test_c_answers_pass_the_official_verifier(
    libraries: dict[str, Library], wire: Wire, host: Host, tmp_path: Path
) -> None:
    source, program = tmp_path / "verify.cpp", tmp_path / "verify"
    source.write_text(VERIFIER.read_text())
    run(["c++", "-std=c++17", f"-I{KIT / 'generated' / 'cpp'}", str(source), "-o", str(program)])
    cases = {
        "full": ("c_example", wire.encode({"correlationid": "c", "b": "x"}, data=b"abc")),
        "bare": ("c_example", wire.encode(data=None, datacontenttype=None, specversion=None)),
        "gateway": ("c_example", wire.encode(subject="gateway", data=b"{}")),
        "fail": ("c_example", wire.encode(subject="fail")),
        "both": ("misbehave", wire.encode(subject="both")),
        "neither": ("misbehave", wire.encode(subject="neither")),
        "garbage": ("misbehave", wire.encode(subject="garbage")),
    }
    for case, (name, buf) in cases.items():
        rc, out = libraries[name].answer(host, buf)
        assert rc == OK and out is not None
        (tmp_path / case).write_bytes(out)
    result = run([str(program), *cases], cwd=tmp_path)
    verdicts = dict(line.split() for line in result.stdout.splitlines())
    assert verdicts == {case: "invalid" if case == "garbage" else "valid" for case in cases}
