"""The native worker kit in native_abi/, on its own: headers, Makefile, generated code, the
engine's declaration of the ABI (read from the header) against what a C compiler makes of the
header, and the C and C++ example libraries called through cffi the way the native engine calls
them (no Redis). Harness and fixtures: tests/native/harness.py."""

from __future__ import annotations

import json
import shutil
import threading
import zipfile
from pathlib import Path

import pytest

from engines.native import abi
from engines.native.library import ffi as engine_ffi
from tests.conftest import need
from tests.native.harness import (
    GATEWAY_FAILED,
    HERE,
    INTERNAL,
    KIT,
    LOG_INFO,
    OK,
    RID,
    ZIPS,
    Answer,
    Host,
    Library,
    Wire,
    ffi,
    run,
)

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
    run([compiler, standard, *flags, "-c", str(source), "-o", str(tmp_path / "out.o")])


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
    run(["make", "-C", str(tmp_path), "generate"])
    assert _files(tmp_path / "generated") == _files(KIT / "generated"), (
        "native_abi/generated is stale: run make -C native_abi generate"
    )


# --- the declaration the engine reads from the header ---------------------------------------

HEADER = KIT / "virtufin_worker_api.h"


def test_the_engine_reads_the_kits_header() -> None:
    assert abi.HEADER_FILE.read_bytes() == HEADER.read_bytes()
    assert set(abi.ABI.prototypes) == {"Process", "FreeResult", "Probe"}
    assert abi.ABI.prototype("Process", "Run").startswith("int32_t Run(const VirtufinHost* host,")


def _compiler() -> str:
    if shutil.which("cc") is None:
        need("cc", FileNotFoundError("cc is not on PATH"))
    return "cc"


def _compile(tmp_path: Path, name: str, lines: list[str], *flags: str) -> Path:
    """``lines`` of C11 compiled strictly against the kit's headers (``-c`` among ``flags``
    makes an object, else a program); the output's path."""
    source, output = tmp_path / f"{name}.c", tmp_path / name
    source.write_text("\n".join([*lines, ""]))
    strict = ["-std=c11", "-pedantic", "-Wall", "-Wextra", "-Werror", f"-I{KIT}"]
    run([_compiler(), *strict, *flags, str(source), "-o", str(output)])
    return output


def test_cffi_lays_the_host_struct_out_as_the_c_compiler_does(tmp_path: Path) -> None:
    """The engine's VirtufinHost, field by field, against the compiler's: offset and size
    of each field cffi declares, the struct's size and alignment."""
    fields = engine_ffi.typeof("VirtufinHost").fields
    lines = [
        "#include <stddef.h>",
        "#include <stdio.h>",
        '#include "virtufin_worker_api.h"',
        "int main(void) {",
        '    printf("VirtufinHost %zu %zu\\n", sizeof(VirtufinHost), _Alignof(VirtufinHost));',
        *(
            f'    printf("{name} %zu %zu\\n", offsetof(VirtufinHost, {name}),'
            f" sizeof(((VirtufinHost*)0)->{name}));"
            for name, _ in fields
        ),
        "    return 0;",
        "}",
    ]
    compiled = run([str(_compile(tmp_path, "layout", lines))]).stdout.splitlines()

    size, align = engine_ffi.sizeof("VirtufinHost"), engine_ffi.alignof("VirtufinHost")
    declared = [f"VirtufinHost {size} {align}"]
    declared += [f"{name} {f.offset} {engine_ffi.sizeof(f.type)}" for name, f in fields]
    assert compiled == declared
    assert len(fields) == 5


def test_the_prototypes_are_the_headers_also_renamed(tmp_path: Path) -> None:
    """Each prototype as the engine declares it, after the header: a C compiler refuses a
    redeclaration that differs; one renamed as manifest.json may has the same type."""
    lines = ['#include "virtufin_worker_api.h"', *abi.ABI.prototypes.values()]
    for export in abi.ABI.prototypes:
        lines.append(abi.ABI.prototype(export, f"Renamed{export}"))
        lines.append(
            f"_Static_assert(__builtin_types_compatible_p(__typeof__({export}), "
            f'__typeof__(Renamed{export})), "{export}");'
        )
    _compile(tmp_path, "prototypes", lines, "-c")


def test_the_constants_are_the_headers(tmp_path: Path) -> None:
    """Every integer macro the header defines, as the C preprocessor sees them."""
    source = tmp_path / "constants.c"
    source.write_text('#include "virtufin_worker_api.h"\n')
    macros = run([_compiler(), "-dM", "-E", f"-I{KIT}", str(source)]).stdout
    defined = {
        name: int(value)
        for name, value in (
            line.split()[1:] for line in macros.splitlines() if len(line.split()) == 3
        )
        if name.startswith("VIRTUFIN_")
    }
    assert defined == abi.ABI.constants
    assert defined["VIRTUFIN_ABI_VERSION"] == abi.ABI_VERSION == 1


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
