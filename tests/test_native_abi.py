"""The native worker kit in native_abi/, on its own: headers, Makefile, generated code, and the
example libraries called through cffi the way the native engine calls them (no engine, no
Redis).

FlatBuffers are written and read with the flatc-generated Python code, the reference the
engine's codec is tested against. Inputs that could crash a library go to a child process, so
a crash fails the test instead of ending pytest.
"""

from __future__ import annotations

import importlib
import json
import platform
import random
import shutil
import signal
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import cffi
import flatbuffers
import pytest

from tests.conftest import ROOT, need

KIT = ROOT / "native_abi"
#: C, C++ and Python sources the tests build or run.
HERE = ROOT / "tests" / "native"
#: Library name of each example worker -> its zip.
ZIPS = {
    "c_example": "c-example.zip",
    "cpp_example": "cpp-example.zip",
    "misbehave": "misbehave.zip",
}
RID = {"x86_64": "linux-x64", "aarch64": "linux-arm64"}.get(platform.machine(), "unsupported")

#: virtufin_worker_api.h, as cffi declares it; the two counters only misbehave exports.
CDEF = """
typedef struct VirtufinHost {
    void*   engine_ptr;
    int32_t abi_version;
    void    (*log)(int32_t level, const char* message);
    int32_t (*gateway_call)(const char* service, const char* method,
                            const uint8_t* request, int32_t request_len,
                            uint8_t** response, int32_t* response_len);
    void    (*free_response)(uint8_t* response);
} VirtufinHost;
int32_t Process(const VirtufinHost* host, const uint8_t* in_buf, int32_t in_len,
                uint8_t** out_buf, int32_t* out_len);
void FreeResult(uint8_t* out_buf);
int32_t OutstandingResults(void);
int32_t FreedTwice(void);
void* malloc(size_t size);
void free(void* block);
"""
OK, INVALID_INPUT, INTERNAL = 0, 1, 2
GATEWAY_OK, GATEWAY_FAILED = 0, 1
LOG_INFO = 2

ffi = cffi.FFI()
ffi.cdef(CDEF)

#: The input event of most tests, as the host would send it.
EVENT = {
    "id": "evt-1",
    "source": "/tests",
    "type": "orders.created",
    "specversion": "1.0",
    "datacontenttype": "text/plain",
}
STRING_FIELDS = ("id", "source", "type", "specversion", "datacontenttype", "subject", "time")


@dataclass(frozen=True)
class Answer:
    """A decoded WorkerResponse."""

    error: str | None
    event: dict[str, Any] | None


@dataclass(frozen=True)
class Wire:
    """worker_api.fbs through its flatc-generated Python code (modules CloudEvent, Extension,
    WorkerResponse of the package virtufin.worker)."""

    event: ModuleType
    extension: ModuleType
    response: ModuleType

    def encode(
        self, extensions: dict[str, str] | None = None, data: bytes | None = b"", **strings: Any
    ) -> bytes:
        """A CloudEvent as the host sends it (extensions sorted by key); ``strings`` override
        EVENT's (None leaves one out)."""
        builder = flatbuffers.Builder(256)
        fields = {k: v for k, v in {**EVENT, **strings}.items() if v is not None}
        offsets = {name: builder.CreateString(value) for name, value in fields.items()}
        data_vector = None if data is None else builder.CreateByteVector(data)
        tables = [self._extension(builder, k, v) for k, v in sorted((extensions or {}).items())]
        self.event.StartExtensionsVector(builder, len(tables))
        for table in reversed(tables):
            builder.PrependUOffsetTRelative(table)
        vector = builder.EndVector()
        self.event.Start(builder)
        for name, offset in offsets.items():
            getattr(self.event, "Add" + name.capitalize())(builder, offset)
        if data_vector is not None:
            self.event.AddData(builder, data_vector)
        if tables:
            self.event.AddExtensions(builder, vector)
        builder.Finish(self.event.End(builder))
        return bytes(builder.Output())

    def _extension(self, builder: flatbuffers.Builder, key: str, value: str) -> int:
        key_offset, value_offset = builder.CreateString(key), builder.CreateString(value)
        self.extension.Start(builder)
        self.extension.AddKey(builder, key_offset)
        self.extension.AddValue(builder, value_offset)
        return int(self.extension.End(builder))

    def decode(self, buf: bytes) -> Answer:
        root = self.response.WorkerResponse.GetRootAs(buf, 0)
        event, error = root.ResultEvent(), root.ErrorMessage()
        return Answer(_text(error), None if event is None else _event(event))


def _text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode()


def _event(event: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        name: _text(getattr(event, name.capitalize())()) for name in STRING_FIELDS
    }
    fields["data"] = (
        None if event.DataIsNone() else bytes(event.Data(i) for i in range(event.DataLength()))
    )
    extensions = (event.Extensions(i) for i in range(event.ExtensionsLength()))
    fields["extensions"] = [(_text(e.Key()), _text(e.Value())) for e in extensions]
    return fields


class Host:
    """A VirtufinHost: log records the messages, gateway_call records the call and answers
    ``reply`` with ``status`` in a block from libc's malloc, which free_response frees."""

    def __init__(self, libc: Any) -> None:
        self.libc = libc
        self.reply, self.status = b'{"pong": true}', GATEWAY_OK
        self.logs: list[tuple[int, str]] = []
        self.calls: list[tuple[str, str, bytes]] = []
        self.unfreed: set[int] = set()
        self.strays: list[int] = []
        self._callbacks = {
            "log": ffi.callback("void(int32_t, const char *)", self._log),
            "gateway_call": ffi.callback(
                "int32_t(const char *, const char *, const uint8_t *, int32_t, uint8_t **,"
                " int32_t *)",
                self._gateway_call,
            ),
            "free_response": ffi.callback("void(uint8_t *)", self._free_response),
        }
        self.struct = ffi.new("VirtufinHost *", {"abi_version": 1, **self._callbacks})

    def _log(self, level: int, message: Any) -> None:
        self.logs.append((level, ffi.string(message).decode()))

    def _gateway_call(
        self, service: Any, method: Any, request: Any, length: int, response: Any, size: Any
    ) -> int:
        body = b"" if request == ffi.NULL else bytes(ffi.buffer(request, length))
        self.calls.append((ffi.string(service).decode(), ffi.string(method).decode(), body))
        block = ffi.cast("uint8_t *", self.libc.malloc(len(self.reply)))
        ffi.memmove(block, self.reply, len(self.reply))
        self.unfreed.add(int(ffi.cast("uintptr_t", block)))
        response[0], size[0] = block, len(self.reply)
        return self.status

    def _free_response(self, response: Any) -> None:
        address = int(ffi.cast("uintptr_t", response))
        if address not in self.unfreed:
            self.strays.append(address)  # freed twice, or never handed out: leave it
            return
        self.unfreed.remove(address)
        self.libc.free(response)


@dataclass(frozen=True)
class Library:
    """One loaded worker library."""

    lib: Any

    def process(self, host: Host, buf: bytes) -> tuple[int, Any, int]:
        """Calls Process: its code, out_buf and out_len, which the caller must free."""
        out, out_len = ffi.new("uint8_t **"), ffi.new("int32_t *")
        rc = self.lib.Process(
            host.struct, ffi.from_buffer("uint8_t[]", buf), len(buf), out, out_len
        )
        return rc, out[0], out_len[0]

    def answer(self, host: Host, buf: bytes) -> tuple[int, bytes | None]:
        """Calls Process and FreeResult: its code and a copy of its answer."""
        rc, out, size = self.process(host, buf)
        if out == ffi.NULL:
            return rc, None
        try:
            return rc, bytes(ffi.buffer(out, size))
        finally:
            self.lib.FreeResult(out)


def _run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout}{result.stderr}"
    return result


@pytest.fixture(scope="module")
def build(native_zips: dict[str, Path]) -> Path:
    """Where ``make -C native_abi BUILD=<dir>`` put the worker zips (conftest runs it once)."""
    return native_zips["c-example"].parent


@pytest.fixture(scope="module")
def library_paths(build: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each example's library, taken out of its zip."""
    out = tmp_path_factory.mktemp("native-libraries")
    paths = {}
    for name, zip_name in ZIPS.items():
        entry = f"runtimes/{RID}/native/lib{name}.so"
        with zipfile.ZipFile(build / zip_name) as archive:
            paths[name] = Path(archive.extract(entry, out / name))
    return paths


@pytest.fixture(scope="module")
def libraries(library_paths: dict[str, Path]) -> Iterator[dict[str, Library]]:
    """The libraries loaded in this process, each with VIRTUFIN_WORKER_ID worker-<name> at load
    time and another value afterwards: a library must read its identity once, at load."""
    loaded: dict[str, Library] = {}
    with pytest.MonkeyPatch.context() as env:
        for name, path in library_paths.items():
            env.setenv("VIRTUFIN_WORKER_ID", f"worker-{name}")
            loaded[name] = Library(ffi.dlopen(str(path)))
        env.setenv("VIRTUFIN_WORKER_ID", "set-after-load")
        yield loaded
    for library in loaded.values():
        ffi.dlclose(library.lib)


@pytest.fixture(scope="module")
def wire() -> Iterator[Wire]:
    """The generated Python code, imported from native_abi/generated/python."""
    generated = str(KIT / "generated" / "python")
    sys.path.insert(0, generated)
    try:
        modules = ("CloudEvent", "Extension", "WorkerResponse")
        yield Wire(*(importlib.import_module(f"virtufin.worker.{name}") for name in modules))
    finally:
        sys.path.remove(generated)


@pytest.fixture(scope="module")
def libc() -> Any:
    return ffi.dlopen(None)


@pytest.fixture
def host(libc: Any) -> Host:
    return Host(libc)


# --- the kit -------------------------------------------------------------------------------------

#: Uses every function of virtufin_flatbuf.h, so that each is compiled and analysed.
EVERY_FUNCTION = HERE / "every_function.c"


@pytest.mark.parametrize(
    ("compiler", "standard", "suffix"), [("cc", "-std=c99", "c"), ("c++", "-std=c++11", "cpp")]
)
def test_headers_compile_clean(tmp_path: Path, compiler: str, standard: str, suffix: str) -> None:
    if shutil.which(compiler) is None:
        need(compiler, FileNotFoundError(f"{compiler} is not on PATH"))
    source = tmp_path / f"every_function.{suffix}"
    source.write_text(EVERY_FUNCTION.read_text())
    flags = ["-pedantic", "-Wall", "-Wextra", "-Werror", "-O2", f"-I{KIT}"]
    _run([compiler, standard, *flags, "-c", str(source), "-o", str(tmp_path / "out.o")])


def test_make_builds_the_three_worker_zips(build: Path) -> None:
    for name, zip_name in ZIPS.items():
        with zipfile.ZipFile(build / zip_name) as archive:
            assert archive.namelist() == ["manifest.json", f"runtimes/{RID}/native/lib{name}.so"]
            assert json.loads(archive.read("manifest.json")) == {"abi_version": 1, "library": name}
            assert archive.read(archive.namelist()[1])[:4] == b"\x7fELF"


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in root.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    if shutil.which("flatc") is None:
        pytest.skip("flatc is not on PATH, so native_abi/generated cannot be checked against it")
    for name in ("Makefile", "worker_api.fbs"):
        shutil.copy(KIT / name, tmp_path / name)
    _run(["make", "-C", str(tmp_path), "generate"])
    assert _files(tmp_path / "generated") == _files(KIT / "generated"), (
        "native_abi/generated is stale: run make -C native_abi generate"
    )


# --- the C and C++ examples ----------------------------------------------------------------------

EXAMPLES = pytest.mark.parametrize(
    ("name", "engine"), [("c_example", "c"), ("cpp_example", "cpp")], ids=["c", "cpp"]
)


@EXAMPLES
def test_example_answers_the_processed_event(
    libraries: dict[str, Library], wire: Wire, host: Host, name: str, engine: str
) -> None:
    extensions = {"correlationid": "corr-7", "traceparent": "00-ab", "aaa": "first"}
    buf = wire.encode(extensions, data=b"hello, World 42 \xff")
    rc, out = libraries[name].answer(host, buf)
    assert rc == OK and out is not None
    answer = wire.decode(out)
    assert answer.error is None and answer.event is not None
    assert answer.event == {
        "id": "evt-1",
        "source": f"/native/{name.replace('_', '-')}",
        "type": "orders.created.processed",
        "specversion": "1.0",
        "datacontenttype": "text/plain",
        "subject": None,
        "time": None,
        "data": b"HELLO, WORLD 42 \xff",
        "extensions": [
            ("correlationid", "corr-7"),
            ("engine", engine),
            ("workerid", f"worker-{name}"),
        ],
    }
    assert host.logs == [(LOG_INFO, "processing evt-1")]


@EXAMPLES
def test_example_leaves_out_what_the_input_lacks(
    libraries: dict[str, Library], wire: Wire, host: Host, name: str, engine: str
) -> None:
    rc, out = libraries[name].answer(host, wire.encode(data=None, datacontenttype=None))
    assert rc == OK and out is not None
    event = wire.decode(out).event
    assert event is not None
    assert (event["data"], event["datacontenttype"]) == (None, None)
    assert event["extensions"] == [("engine", engine), ("workerid", f"worker-{name}")]


@EXAMPLES
def test_example_answers_the_gateway_response(
    libraries: dict[str, Library], wire: Wire, host: Host, name: str, engine: str
) -> None:
    host.reply = b'{"pong": "PING"}'
    rc, out = libraries[name].answer(host, wire.encode(subject="gateway", data=b'{"ping": 1}'))
    assert rc == OK and out is not None
    event = wire.decode(out).event
    assert event is not None
    assert (event["data"], event["datacontenttype"]) == (host.reply, "application/json")
    assert host.calls == [("echo", "ping", b'{"ping": 1}')]
    assert (host.unfreed, host.strays) == (set(), []), "free_response not called once"


@EXAMPLES
def test_example_answers_a_failed_gateway_call_as_an_error(
    libraries: dict[str, Library], wire: Wire, host: Host, name: str, engine: str
) -> None:
    host.reply, host.status = b'{"error": "refused"}', GATEWAY_FAILED
    rc, out = libraries[name].answer(host, wire.encode(subject="gateway", data=b"{}"))
    assert rc == OK and out is not None
    assert wire.decode(out) == Answer('gateway call failed: {"error": "refused"}', None)
    assert (host.unfreed, host.strays) == (set(), []), "free_response not called once"


@EXAMPLES
def test_example_fails_when_asked(
    libraries: dict[str, Library], wire: Wire, host: Host, name: str, engine: str
) -> None:
    rc, out = libraries[name].answer(host, wire.encode(subject="fail"))
    assert rc == OK and out is not None
    assert wire.decode(out) == Answer("asked to fail", None)
    rc, out_buf, _ = libraries[name].process(host, wire.encode(subject="rc"))
    assert (rc, out_buf) == (INTERNAL, ffi.NULL)


@EXAMPLES
def test_example_is_reentrant(
    libraries: dict[str, Library], wire: Wire, host: Host, name: str, engine: str
) -> None:
    inputs = [wire.encode(id=f"evt-{i}", data=f"item {i}".encode()) for i in range(8)]
    wrong: list[str] = []

    def work(buf: bytes, expected: bytes) -> None:
        for _ in range(100):
            rc, out = libraries[name].answer(host, buf)
            event = wire.decode(out).event if rc == OK and out else None
            if event is None or event["data"] != expected:
                wrong.append(f"rc={rc} event={event}")

    threads = [
        threading.Thread(target=work, args=(buf, f"ITEM {i}".encode()))
        for i, buf in enumerate(inputs)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


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
    _run(["c++", "-std=c++17", f"-I{KIT / 'generated' / 'cpp'}", str(source), "-o", str(program)])
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
    result = _run([str(program), *cases], cwd=tmp_path)
    verdicts = dict(line.split() for line in result.stdout.splitlines())
    assert verdicts == {case: "invalid" if case == "garbage" else "valid" for case in cases}
