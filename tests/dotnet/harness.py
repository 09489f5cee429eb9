"""Fixtures of the .NET engine tests (a pytest plugin, see conftest's ``pytest_plugins``).

``dotnet`` checks that a runtime and Mono's compiler are here (locally their absence skips
the test with the reason; in CI it fails it); ``engine_for`` loads engines and closes them
after the test (with the test module's ``settings``); ``dotnet_packages`` builds the example
workers the way a user without a .NET SDK does, with ``python -m engines.dotnet``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.dotnet import runtime
from engines.dotnet.engine import CSharpEngine, DotNetEngine
from tests.conftest import ROOT, need
from wm.config import Settings
from wm.engine import WorkerSpec
from wm.errors import EngineUnavailable

EXAMPLES = ROOT / "engines" / "dotnet" / "examples"


@pytest.fixture(scope="session")
def dotnet() -> runtime.Root:
    """The runtime the engines will use; the test is skipped (failed in CI) without one."""
    try:
        root = runtime.discover()
    except EngineUnavailable as exc:
        need(".NET runtime", exc)
    if not runtime.MONO_COMPILER.is_file():
        need("Mono's C# compiler", FileNotFoundError(f"{runtime.MONO_COMPILER} (mono-devel)"))
    try:
        import pythonnet  # noqa: F401
    except ModuleNotFoundError as exc:
        need("pythonnet", exc)
    return root


def worker(worker_id: str = "w-dotnet", **settings: Any) -> WorkerSpec:
    return WorkerSpec(worker_id=worker_id, topic="orders", settings=settings)


@pytest.fixture
def engine_for(dotnet: runtime.Root, settings: Settings) -> Iterator[Any]:
    """``engine_for(code, spec, cls)``: a loaded engine, closed after the test."""
    engines: list[DotNetEngine] = []

    def make(code: bytes, spec: WorkerSpec | None = None, cls: type = CSharpEngine) -> Any:
        engine = cls(settings)
        engines.append(engine)
        engine.load(code, spec or worker())
        return engine

    yield make
    for engine in engines:
        engine.close()


def build(*args: str | Path) -> None:
    """``python -m engines.dotnet ARGS`` (a fresh process: the runtime it starts ends with it)."""
    result = subprocess.run(
        [sys.executable, "-m", "engines.dotnet", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, f"python -m engines.dotnet {args} failed:\n{result.stderr}"


@pytest.fixture(scope="session")
def dotnet_packages(
    dotnet: runtime.Root, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The examples as a user ships them: ``command`` (CommandWorker.cs compiled into a nupkg)
    and ``greeting`` (a worker and its sibling dependency in a nupkg)."""
    out = tmp_path_factory.mktemp("dotnet-build")
    build("compile", EXAMPLES / "CommandWorker.cs", "-o", out / "OrderWorker.dll")
    build("pack", out / "OrderWorker.dll", "--id", "OrderWorker", "-o", out / "command.nupkg")
    build("compile", EXAMPLES / "nupkg" / "Greeter.cs", "-o", out / "Greeter.dll")
    build(
        "compile",
        EXAMPLES / "nupkg" / "GreetingWorker.cs",
        *("-r", out / "Greeter.dll", "-o", out / "GreetingWorker.dll"),
    )
    build(
        "pack",
        *(out / "GreetingWorker.dll", out / "Greeter.dll"),
        *("--id", "GreetingWorker", "-o", out / "greeting.nupkg"),
    )
    return {"command": out / "command.nupkg", "greeting": out / "greeting.nupkg"}
