"""Host side of the native engine's isolation mode: the library runs in a helper process
(:mod:`engines.native.helper`), so a crash or a hang costs one failed delivery, not the node.

How a helper is started, called, timed out and restarted is :mod:`engines.isolation.host`;
what is native is the init spec (the manifest's file name and exports, the optional Probe
among them, with the library's bytes) and the failures the helper can report: a return code
(NativeCallFailed), an unusable answer (NativeOutputRefused), a library that does not load
(InvalidCode).
"""

from __future__ import annotations

from collections.abc import Mapping

from engines.childproc.limits import Limits
from engines.isolation.host import Callbacks, HelperProcess
from engines.native.library import NativeCallFailed, NativeOutputRefused
from engines.native.package import Package, library_file
from wm.config import Settings
from wm.errors import InvalidCode, OutputTooLarge

#: The module the helper process runs (``python -m``).
HELPER_MODULE = "engines.native.helper"
#: Refusals the helper reports by type name.
REFUSALS: dict[str, type[Exception]] = {
    "InvalidCode": InvalidCode,
    "NativeOutputRefused": NativeOutputRefused,
    "OutputTooLarge": OutputTooLarge,
}


def start_helper(
    package: Package, env: Mapping[str, str | None], sinks: Callbacks, settings: Settings
) -> HelperProcess:
    """A helper that loaded ``package``'s library, with ``env`` set over the host's, within
    the settings' limits, refusing outputs over their ``max_output_bytes``; InvalidCode if
    the library does not load there."""
    manifest = package.manifest
    spec = {
        "file_name": library_file(manifest.library),
        "entry_point": manifest.entry_point,
        "free_result": manifest.free_result,
        "probe": manifest.probe,
        "max_output_bytes": settings.max_output_bytes,
    }
    return HelperProcess(
        HELPER_MODULE,
        spec,
        package.library,
        env,
        sinks,
        description="native",
        refusals=REFUSALS,
        coded_failure=NativeCallFailed,
        loads=package.entry,
        limits=Limits.from_settings(settings),
        spin_s=settings.engine_spin_s,
    )
