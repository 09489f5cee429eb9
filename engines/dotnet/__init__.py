"""The .NET engines (MIME ``application/x-dotnet-dll`` and ``text/x-csharp``): C# workers
written against the C# DevKit (``Virtufin.Worker.DevKit``), run in-process on CoreCLR
through pythonnet, one collectible AssemblyLoadContext per loaded worker.

Modules: ``runtime`` (discovery, start once per process after fork, the DevKit and host
helper built from ``csharp/`` and cached by hash, the compiler), ``package`` (bare DLL or
nupkg, best ``lib/<tfm>/``), ``wire`` (events as UTF-8 bytes between Python and the
host helper), ``engine`` (the engines, in-process contexts and isolated helpers), ``helper``
(``python -m engines.dotnet.helper``: the isolation helper process).

pythonnet is imported only by this package; without it the engines are reported
unavailable with the extra to install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wm.extras import install_hint

if TYPE_CHECKING:
    from engines.dotnet.engine import CSharpEngine, DotNetDllEngine

__all__ = ["CSharpEngine", "DotNetDllEngine"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        try:
            from engines.dotnet import engine
        except ModuleNotFoundError as exc:
            if exc.name not in ("defusedxml", "pythonnet", "clr_loader"):
                raise
            raise ImportError(
                f"the .NET engines need {exc.name}: {install_hint('dotnet')}"
            ) from exc
        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
