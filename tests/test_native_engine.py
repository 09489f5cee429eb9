"""The native engine on the example workers of native_abi/ (built with its Makefile): the ABI
round trip, every refusal of seed 001, identity, reload, concurrency, the gateway, and
isolation mode surviving a crashing library."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.native.engine import NativeEngine, Sinks
from engines.native.library import NativeCallFailed, NativeOutputRefused
from engines.native.package import running_rid
from tests.helpers import idle_cpu_s
from wm.config import Settings
from wm.engine import Outputs, WorkerSpec
from wm.errors import InvalidCode, OutputTooLarge, WorkerExecutionError, WorkerTimeout
from wm.events import CloudEvent, make_event

WORKER = WorkerSpec(worker_id="w-native-1", topic="orders", group="g1")


def event(subject: str | None = None, data: Any = None, **extensions: str) -> CloudEvent:
    return make_event(
        "orders",
        "/tests",
        {"item": "book"} if data is None else data,
        subject=subject,
        extensions=extensions,
    )


@pytest.fixture
def engine() -> Iterator[NativeEngine]:
    engine = NativeEngine(Settings.from_env())
    yield engine
    engine.close()


def zip_bytes(path: Path) -> bytes:
    return path.read_bytes()


def rezip(source: Path, manifest: Any = None, *, drop: str = "", rename: str = "") -> bytes:
    """The worker zip at ``source`` with its manifest replaced or entries dropped/renamed."""
    out = io.BytesIO()
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(out, "w") as new:
        for info in old.infolist():
            if info.filename == drop:
                continue
            data = old.read(info)
            name = info.filename.replace(running_rid(), rename) if rename else info.filename
            if name == "manifest.json" and manifest is not None:
                data = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
            new.writestr(name, data)
    return out.getvalue()


def outstanding(engine: NativeEngine) -> int:
    """Buffers the misbehave library handed out that FreeResult has not taken back (and,
    by the thousand, those it was given twice)."""
    library = engine._runner.library  # type: ignore[union-attr]
    counters = library.declare("int32_t OutstandingResults(void); int32_t FreedTwice(void);")
    return int(counters.OutstandingResults()) + 1000 * int(counters.FreedTwice())


@pytest.mark.parametrize("example", ["c-example", "cpp-example"])
def test_example_answers_with_identity_and_correlation_id(
    engine: NativeEngine, native_zips: dict[str, Path], example: str, caplog: Any
) -> None:
    caplog.set_level(logging.INFO, logger="engines.native.worker")
    engine.load(zip_bytes(native_zips[example]), WORKER)
    incoming = event(data={"item": "book"}, correlationid="corr-1")

    [out] = engine.process(incoming, timeout_s=5)

    assert out.get_type() == "orders.processed"
    assert out.get_extension("correlationid") == "corr-1"
    assert out.get_extension("workerid") == "w-native-1"
    assert out.get_extension("engine") == example.split("-")[0]
    assert out.get_data() == {"ITEM": "BOOK"}
    assert f"processing {incoming.get_id()}" in caplog.text


def test_error_message_is_the_workers_answer(
    engine: NativeEngine, native_zips: dict[str, Path]
) -> None:
    engine.load(zip_bytes(native_zips["c-example"]), WORKER)
    outputs = engine.process(event("fail"), timeout_s=5)
    assert isinstance(outputs, Outputs)
    assert outputs.worker_error == "asked to fail"
    [answer] = outputs
    assert answer.get_type() == "orders.error"
    assert answer.get_data() == {"error": "asked to fail"}


def test_non_zero_return_code_is_a_failed_delivery(
    engine: NativeEngine, native_zips: dict[str, Path]
) -> None:
    engine.load(zip_bytes(native_zips["c-example"]), WORKER)
    with pytest.raises(NativeCallFailed, match=r"2 \(VIRTUFIN_ERR_INTERNAL\)") as failed:
        engine.process(event("rc"), timeout_s=5)
    assert failed.value.retryable and failed.value.code == 2


@pytest.mark.parametrize(
    ("subject", "message"),
    [
        ("garbage", "invalid WorkerResponse"),
        ("null", "no output buffer"),
        ("negative", "output length of -5"),
        ("huge", "output length of 2147483647 bytes, over WM_MAX_OUTPUT_BYTES"),
        ("both", "both result_event and error_message"),
        ("neither", "neither result_event nor error_message"),
    ],
)
def test_unusable_answers_are_refused_and_freed_once(
    engine: NativeEngine, native_zips: dict[str, Path], subject: str, message: str
) -> None:
    engine.load(zip_bytes(native_zips["misbehave"]), WORKER)
    refusal = OutputTooLarge if subject == "huge" else NativeOutputRefused  # the core's cap
    with pytest.raises(refusal, match=message) as refused:
        engine.process(event(subject), timeout_s=5)
    assert not refused.value.retryable
    assert outstanding(engine) == 0
    [out] = engine.process(event(), timeout_s=5)  # the host is fine afterwards
    assert out.get_type() == "orders.processed"
    assert outstanding(engine) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"drop": "manifest.json"}, "no manifest.json at its root"),
        ({"manifest": {"abi_version": 1, "library": ""}}, "non-empty library name"),
        ({"manifest": {"abi_version": 1}}, "non-empty library name"),
        ({"manifest": {"abi_version": 1, "library": "../evil"}}, "'../evil' is not a valid name"),
        ({"manifest": {"abi_version": 2, "library": "c_example"}}, "supported: 1"),
        ({"manifest": {"abi_version": "1", "library": "c_example"}}, "integer abi_version"),
        ({"manifest": b"{not json"}, "not valid JSON"),
        (
            {"rename": "linux-s390x"},
            "no library for this machine.*linux-s390x.*linux-x64, linux-arm64",
        ),
        (
            {"manifest": {"abi_version": 1, "library": "c_example", "entry_point": "Nope"}},
            "does not export 'Nope'",
        ),
        (
            {"manifest": {"abi_version": 1, "library": "c_example", "free_result": "free me"}},
            "not a C identifier",
        ),
        (
            {"manifest": {"abi_version": 1, "library": "c_example", "isolation": "vm"}},
            "isolation 'vm'",
        ),
    ],
)
def test_refusals_name_the_defect(
    engine: NativeEngine, native_zips: dict[str, Path], change: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidCode, match=message):
        engine.load(rezip(native_zips["c-example"], **change), WORKER)


def test_not_a_zip_is_refused(engine: NativeEngine) -> None:
    with pytest.raises(InvalidCode, match="must be a zip file"):
        engine.load(b"\x7fELF not a zip", WORKER)


@pytest.mark.parametrize("example", ["c-example", "cpp-example"])
def test_identity_is_set_at_load_and_restored_at_close(
    native_zips: dict[str, Path], monkeypatch: pytest.MonkeyPatch, example: str
) -> None:
    monkeypatch.setenv("VIRTUFIN_WORKER_ID", "prior")
    monkeypatch.setenv("VIRTUFIN_WORKER_GROUP", "prior-group")
    monkeypatch.delenv("VIRTUFIN_WORKER_TOPIC", raising=False)
    engine = NativeEngine(Settings.from_env())
    engine.load(zip_bytes(native_zips[example]), WORKER)
    assert os.environ["VIRTUFIN_WORKER_ID"] == "w-native-1"
    assert os.environ["VIRTUFIN_WORKER_GROUP"] == "g1"
    assert os.environ["VIRTUFIN_WORKER_TOPIC"] == "orders"
    assert os.environ["VIRTUFIN_TENANT_ID"] == "default"
    path = engine._runner.library.path  # type: ignore[union-attr]
    assert not os.path.exists(path), "the library's file is deleted once it is loaded"
    assert path in Path("/proc/self/maps").read_text()
    engine.close()
    assert os.environ["VIRTUFIN_WORKER_ID"] == "prior"
    assert os.environ["VIRTUFIN_WORKER_GROUP"] == "prior-group"
    assert "VIRTUFIN_WORKER_TOPIC" not in os.environ
    assert "VIRTUFIN_TENANT_ID" not in os.environ
    assert path not in Path("/proc/self/maps").read_text(), "close unloads the library"


def test_concurrent_calls_run_at_once(engine: NativeEngine, native_zips: dict[str, Path]) -> None:
    engine.load(zip_bytes(native_zips["misbehave"]), WORKER)
    results: list[str] = []

    def slow() -> None:
        [out] = engine.process(event("slow"), timeout_s=10)
        results.append(out.get_type())

    threads = [threading.Thread(target=slow) for _ in range(4)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    assert results == ["orders.processed"] * 4
    assert elapsed < 4 * 1.5, f"four 1.5 s calls took {elapsed:.1f} s: they did not overlap"


def test_reload_waits_for_the_call_in_flight(
    engine: NativeEngine, native_zips: dict[str, Path]
) -> None:
    engine.load(zip_bytes(native_zips["misbehave"]), WORKER)
    answers: dict[str, Any] = {}

    def slow() -> None:
        [answers["old"]] = engine.process(event("slow"), timeout_s=10)
        answers["old_done"] = time.monotonic()

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.3)  # the slow call is in flight
    engine.load(zip_bytes(native_zips["cpp-example"]), WORKER)
    reloaded = time.monotonic()
    thread.join()
    [new] = engine.process(event(), timeout_s=5)
    assert reloaded >= answers["old_done"], "the reload returned before the call in flight"
    assert answers["old"].get_extension("engine") != "cpp"
    assert new.get_extension("engine") == "cpp"


def test_in_process_timeout_drops_the_late_answer(
    engine: NativeEngine, native_zips: dict[str, Path]
) -> None:
    engine.load(zip_bytes(native_zips["misbehave"]), WORKER)
    with pytest.raises(WorkerTimeout, match=r"over its 0\.5 s limit"):
        engine.process(event("slow"), timeout_s=0.5)
    assert outstanding(engine) == 0


@pytest.mark.parametrize("isolation", ["in-process", "subprocess"])
def test_gateway_call_from_c_reaches_the_server(
    native_zips: dict[str, Path], gateway_port: int, isolation: str
) -> None:
    settings = Settings.from_env().replace(gateway_allowed_hosts=("127.0.0.1",))
    worker = WorkerSpec(
        "w-gw",
        "orders",
        settings={"api_host": "127.0.0.1", "api_port": gateway_port, "isolation": isolation},
    )
    engine = NativeEngine(settings)
    try:
        engine.load(zip_bytes(native_zips["c-example"]), worker)
        [out] = engine.process(event("gateway", {"ask": 1}, correlationid="c"), timeout_s=5)
        assert out.get_data() == {"path": "/echo/ping", "got": {"ask": 1}}
    finally:
        engine.close()


def test_gateway_refuses_a_host_not_allowed(
    native_zips: dict[str, Path], gateway_port: int
) -> None:
    settings = Settings.from_env().replace(gateway_allowed_hosts=())
    worker = WorkerSpec(
        "w-gw", "orders", settings={"api_host": "127.0.0.1", "api_port": gateway_port}
    )
    engine = NativeEngine(settings)
    try:
        engine.load(zip_bytes(native_zips["c-example"]), worker)
        outputs = engine.process(event("gateway", {"ask": 1}), timeout_s=5)
        assert isinstance(outputs, Outputs)
        assert "gateway call failed" in str(outputs.worker_error)
        assert "not allowed" in str(outputs.worker_error)
    finally:
        engine.close()


def test_a_log_line_no_logger_keeps_is_not_read(
    engine: NativeEngine, native_zips: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C example logs "processing <id>" at INFO on every event: below the worker
    logger's level the line is not read from the library (nor formatted) at all."""
    read: list[tuple[int, str]] = []
    monkeypatch.setattr(Sinks, "log", lambda _sinks, level, text: read.append((level, text)))
    worker_logger = logging.getLogger("engines.native.worker")
    engine.load(zip_bytes(native_zips["c-example"]), WorkerSpec("w-log", "orders"))
    kept, previous = event(), worker_logger.level
    try:
        worker_logger.setLevel(logging.WARNING)
        engine.process(event(), timeout_s=5)
        assert read == []
        worker_logger.setLevel(logging.INFO)
        engine.process(kept, timeout_s=5)
    finally:
        worker_logger.setLevel(previous)
    assert read == [(logging.INFO, f"processing {kept.get_id()}")]


ISOLATED = WorkerSpec("w-iso", "orders", settings={"isolation": "subprocess"})


def test_isolated_crash_fails_the_delivery_not_the_host(
    engine: NativeEngine, native_zips: dict[str, Path]
) -> None:
    engine.load(zip_bytes(native_zips["misbehave"]), ISOLATED)
    [out] = engine.process(event(), timeout_s=5)
    assert out.get_type() == "orders.processed"
    with pytest.raises(WorkerExecutionError, match="killed by SIGSEGV") as crashed:
        engine.process(event("crash"), timeout_s=5)
    assert crashed.value.retryable
    [out] = engine.process(event(), timeout_s=5)  # a fresh helper answers
    assert out.get_type() == "orders.processed"


def test_an_idle_helper_polls_for_its_next_call_briefly_then_sleeps(
    engine: NativeEngine, native_zips: dict[str, Path]
) -> None:
    """The helper polls for the host's next frame for WM_ENGINE_SPIN_US (on by default),
    then sleeps: idle, it uses no CPU."""
    assert engine.settings.engine_spin_us > 0
    engine.load(zip_bytes(native_zips["misbehave"]), ISOLATED)
    for _ in range(50):
        engine.process(event(), timeout_s=5)
    [pid] = engine.processes()
    assert idle_cpu_s(pid) < 0.05


@pytest.mark.parametrize("isolation", ["in-process", "subprocess"])
def test_a_library_may_log_from_threads_of_its_own(
    native_zips: dict[str, Path], isolation: str, caplog: Any
) -> None:
    caplog.set_level(logging.INFO, logger="engines.native.worker")
    engine = NativeEngine(Settings.from_env())
    try:
        engine.load(
            zip_bytes(native_zips["misbehave"]),
            WorkerSpec("w-t", "orders", settings={"isolation": isolation}),
        )
        [out] = engine.process(event("threads"), timeout_s=10)
        [again] = engine.process(event(), timeout_s=5)  # the pipes are still in step
    finally:
        engine.close()
    assert out.get_type() == again.get_type() == "orders.processed"
    assert caplog.text.count("chatter from a thread of the worker's own") == 6 * 50


def test_isolated_hang_is_killed_at_the_limit(
    engine: NativeEngine, native_zips: dict[str, Path]
) -> None:
    engine.load(zip_bytes(native_zips["misbehave"]), ISOLATED)
    helper = engine._runner
    pid = helper.pid  # type: ignore[union-attr]
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match="within 1 s"):
        engine.process(event("hang"), timeout_s=1)
    assert time.monotonic() - started < 3
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    [out] = engine.process(event(), timeout_s=5)
    assert out.get_type() == "orders.processed"


def test_isolated_refusals_and_answers_match_in_process(
    engine: NativeEngine, native_zips: dict[str, Path]
) -> None:
    engine.load(zip_bytes(native_zips["misbehave"]), ISOLATED)
    with pytest.raises(NativeOutputRefused, match="no output buffer"):
        engine.process(event("null"), timeout_s=5)
    engine.load(zip_bytes(native_zips["c-example"]), ISOLATED)
    with pytest.raises(NativeCallFailed, match="VIRTUFIN_ERR_INTERNAL"):
        engine.process(event("rc"), timeout_s=5)
    outputs = engine.process(event("fail"), timeout_s=5)
    assert isinstance(outputs, Outputs) and outputs.worker_error == "asked to fail"
    [out] = engine.process(event(correlationid="corr-iso"), timeout_s=5)
    assert out.get_extension("workerid") == "w-iso"
    assert out.get_extension("correlationid") == "corr-iso"


def test_validate_never_loads_the_library_in_the_validating_process(
    engine: NativeEngine, native_zips: dict[str, Path]
) -> None:
    def mapped() -> set[str]:
        return {
            line
            for line in Path("/proc/self/maps").read_text().splitlines()
            if "wm-native-" in line
        }

    before = mapped()
    engine.validate(zip_bytes(native_zips["c-example"]), WORKER)
    assert mapped() == before
    with pytest.raises(InvalidCode, match="does not export 'Nope'"):
        manifest = {"abi_version": 1, "library": "c_example", "entry_point": "Nope"}
        engine.validate(rezip(native_zips["c-example"], manifest), WORKER)
