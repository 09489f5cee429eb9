"""The native engine's health probe (issue 14): the optional ``Probe`` export of a worker
library, run in-process and in an isolation helper, and probed by a real node. The misbehave
example's probe does what ``MISBEHAVE_PROBE`` said when its library loaded."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from engines.native.engine import NativeEngine
from engines.native.library import NativeCallFailed
from tests.helpers import eventually
from tests.native.harness import LOG_INFO, OK, Host, Library
from tests.test_native_engine import event, rezip
from wm import Settings, WorkManager
from wm.engine import WorkerSpec
from wm.errors import InvalidCode, WorkerExecutionError, WorkerTimeout
from wm.state.health import UNHEALTHY, Probes, no_probe_key

NATIVE = "application/x-native-dll"
MODES = pytest.mark.parametrize("isolation", ["in-process", "subprocess"])
#: Chooses the misbehave library's probe when it loads (unset: a passing probe).
PROBE_ENV = "MISBEHAVE_PROBE"
UNHEALTHY_CODE = 4


@pytest.fixture
def engine() -> Iterator[NativeEngine]:
    engine = NativeEngine(Settings.from_env())
    yield engine
    engine.close()


def spec(isolation: str) -> WorkerSpec:
    return WorkerSpec("w-probe", "orders", settings={"isolation": isolation})


def helper_pid(engine: NativeEngine) -> int | None:
    [pid] = engine.processes() or [None]
    return pid


def gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or " Z " in stat.read_text()


def load_misbehave(
    engine: NativeEngine,
    zips: dict[str, Path],
    isolation: str,
    monkeypatch: pytest.MonkeyPatch,
    probe: str | None,
) -> None:
    if probe is None:
        monkeypatch.delenv(PROBE_ENV, raising=False)
    else:
        monkeypatch.setenv(PROBE_ENV, probe)
    engine.load(zips["misbehave"].read_bytes(), spec(isolation))


# --- the kit ---------------------------------------------------------------------------------


def test_the_misbehave_example_exports_a_probe_and_the_c_example_none(
    libraries: dict[str, Library], host: Host
) -> None:
    assert libraries["misbehave"].lib.Probe(host.struct) == OK
    assert host.logs == [(LOG_INFO, "probe: healthy")]
    with pytest.raises(AttributeError, match="Probe"):
        _ = libraries["c_example"].lib.Probe


# --- the engine ------------------------------------------------------------------------------


@MODES
def test_a_library_without_the_export_has_no_probe(
    engine: NativeEngine, native_zips: dict[str, Path], isolation: str
) -> None:
    engine.load(native_zips["c-example"].read_bytes(), spec(isolation))
    assert engine.probe(timeout_s=5) is None
    [out] = engine.process(event(), timeout_s=5)
    assert out.get_type() == "orders.processed"


@MODES
def test_a_passing_probe_answers_true_with_the_host_it_was_given(
    engine: NativeEngine,
    native_zips: dict[str, Path],
    isolation: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: Any,
) -> None:
    caplog.set_level(logging.INFO, logger="engines.native.worker")
    load_misbehave(engine, native_zips, isolation, monkeypatch, None)
    assert engine.probe(timeout_s=5) is True
    assert "native worker w-probe: probe: healthy" in caplog.text
    [out] = engine.process(event(), timeout_s=5)  # an isolated helper is still in step
    assert out.get_type() == "orders.processed"


@MODES
def test_a_failing_probe_raises_naming_its_code(
    engine: NativeEngine,
    native_zips: dict[str, Path],
    isolation: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: Any,
) -> None:
    caplog.set_level(logging.INFO, logger="engines.native.worker")
    load_misbehave(engine, native_zips, isolation, monkeypatch, "fail")
    pid = helper_pid(engine)
    with pytest.raises(NativeCallFailed, match=r"^Probe returned 4 \(VIRTUFIN_ERR_UNHEALTHY\)$"):
        engine.probe(timeout_s=5)
    with pytest.raises(NativeCallFailed) as failed:
        engine.probe(timeout_s=5)
    assert failed.value.code == UNHEALTHY_CODE
    assert "probe: asked to fail" in caplog.text
    assert helper_pid(engine) == pid  # a failed probe is no broken helper
    [out] = engine.process(event(), timeout_s=5)
    assert out.get_type() == "orders.processed"


def test_an_isolated_probe_past_its_limit_has_its_helper_killed(
    engine: NativeEngine, native_zips: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    load_misbehave(engine, native_zips, "subprocess", monkeypatch, "hang")
    pid = helper_pid(engine)
    assert pid is not None
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"probe did not finish within 0\.5 s"):
        engine.probe(timeout_s=0.5)
    assert time.monotonic() - started < 3
    assert gone(pid)
    [out] = engine.process(event(), timeout_s=5)  # a fresh helper answers
    assert out.get_type() == "orders.processed"
    assert helper_pid(engine) not in (None, pid)


def test_an_isolated_probe_that_crashes_fails_and_spares_the_host(
    engine: NativeEngine, native_zips: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    load_misbehave(engine, native_zips, "subprocess", monkeypatch, "crash")
    with pytest.raises(WorkerExecutionError, match="while running its probe: killed by SIGSEGV"):
        engine.probe(timeout_s=5)
    [out] = engine.process(event(), timeout_s=5)
    assert out.get_type() == "orders.processed"


def test_an_in_process_probe_past_its_limit_fails_when_it_returns(
    engine: NativeEngine, native_zips: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    load_misbehave(engine, native_zips, "in-process", monkeypatch, "slow")
    with pytest.raises(WorkerTimeout, match=r"in Probe, over its 0\.5 s limit"):
        engine.probe(timeout_s=0.5)
    assert engine.probe(timeout_s=5) is True


@pytest.mark.parametrize(
    ("manifest", "probe"),
    [({"probe": "Probe"}, True), ({"probe": "NoSuchProbe"}, None)],
)
def test_the_manifest_names_the_export(
    engine: NativeEngine,
    native_zips: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    manifest: dict[str, str],
    probe: bool | None,
) -> None:
    monkeypatch.delenv(PROBE_ENV, raising=False)
    code = rezip(native_zips["misbehave"], {"abi_version": 1, "library": "misbehave", **manifest})
    engine.load(code, spec("in-process"))
    assert engine.probe(timeout_s=5) is probe


@pytest.mark.parametrize(
    ("name", "message"),
    [("Process", "names 'Process' as probe and as another export"), ("a b", "not a C identifier")],
)
def test_a_bad_probe_name_is_refused(
    engine: NativeEngine, native_zips: dict[str, Path], name: str, message: str
) -> None:
    code = rezip(
        native_zips["misbehave"], {"abi_version": 1, "library": "misbehave", "probe": name}
    )
    with pytest.raises(InvalidCode, match=message):
        engine.load(code, spec("in-process"))


def test_probe_before_load_is_an_error(engine: NativeEngine) -> None:
    with pytest.raises(WorkerExecutionError, match=r"probe\(\) called before load\(\)"):
        engine.probe(timeout_s=5)


# --- a real node -----------------------------------------------------------------------------


@pytest.mark.slow
@MODES
def test_a_node_records_a_failing_native_probe_and_skips_a_library_without_one(
    pg_settings: Settings, start_node: Any, native_zips: dict[str, Path], isolation: str
) -> None:
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(settings)
    probe_settings = {"probe_interval_s": 1, "max_probe_failures": 2, "isolation": isolation}
    sick = manager.create_worker(
        code=native_zips["misbehave"].read_bytes(),
        mime_type=NATIVE,
        topic="np.sick",
        name="sick",
        # degrade: it stays running, paused while unhealthy (remove would take it out)
        settings={**probe_settings, "recovery_on_health": "degrade"},
    )
    quiet = manager.create_worker(
        code=native_zips["c-example"].read_bytes(),
        mime_type=NATIVE,
        topic="np.quiet",
        settings=probe_settings,
    )
    node = start_node(settings, **{PROBE_ENV: "fail"})
    probes = Probes(settings)

    eventually(lambda: manager.get_worker("sick").health == UNHEALTHY, timeout_s=60)
    facts = probes.last(str(sick.id))
    assert facts is not None and facts.failures >= 2
    assert facts.error == "Probe returned 4 (VIRTUFIN_ERR_UNHEALTHY)"
    client = redis.Redis.from_url(settings.redis_url)
    eventually(lambda: client.exists(no_probe_key(str(quiet.id), 1)), timeout_s=30)
    assert probes.last(str(quiet.id)) is None
    assert f"worker {quiet.id} v1 has no probe" in node.log.read_text()
