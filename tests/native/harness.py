"""The harness of the native kit's tests: the example libraries loaded through cffi the way the
native engine calls them, FlatBuffers written and read with the flatc-generated Python code
(the reference the engine's codec is tested against), and their fixtures (a pytest plugin,
named in tests/conftest.py)."""

from __future__ import annotations

import importlib
import platform
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import cffi
import flatbuffers
import pytest

from engines.native.abi import ABI, ABI_VERSION
from tests.conftest import ROOT

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

#: virtufin_worker_api.h as cffi declares it (the engine's declarations, read from the header),
#: with what only misbehave exports (the two counters) and libc's allocator.
CDEF = "\n".join(
    [
        ABI.types,
        *ABI.prototypes.values(),
        "int32_t OutstandingResults(void);",
        "int32_t FreedTwice(void);",
        "void* malloc(size_t size);",
        "void free(void* block);",
    ]
)
OK, INVALID_INPUT, INTERNAL = (
    ABI.constants["VIRTUFIN_" + name] for name in ("OK", "ERR_INVALID_INPUT", "ERR_INTERNAL")
)
GATEWAY_OK, GATEWAY_FAILED = (
    ABI.constants["VIRTUFIN_GATEWAY_OK"],
    ABI.constants["VIRTUFIN_GATEWAY_FAILED"],
)
LOG_INFO = ABI.constants["VIRTUFIN_LOG_INFO"]

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
        return Answer(text(error), None if event is None else event_fields(event))


def text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode()


def event_fields(event: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        name: text(getattr(event, name.capitalize())()) for name in STRING_FIELDS
    }
    fields["data"] = (
        None if event.DataIsNone() else bytes(event.Data(i) for i in range(event.DataLength()))
    )
    extensions = (event.Extensions(i) for i in range(event.ExtensionsLength()))
    fields["extensions"] = [(text(e.Key()), text(e.Value())) for e in extensions]
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
        self.struct = ffi.new("VirtufinHost *", {"abi_version": ABI_VERSION, **self._callbacks})

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


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
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
