"""A native worker's zip: ``manifest.json`` and ``runtimes/<rid>/native/<library file>``.

Reading one checks everything the seed lists before anything is loaded: the zip itself, the
manifest (``abi_version`` supported, ``library`` matching ``[A-Za-z0-9_.-]+``, optional
``entry_point`` / ``free_result`` / ``probe`` / ``isolation``; other fields are ignored),
and an entry for the running machine's RID with the platform's file name.
"""

from __future__ import annotations

import io
import json
import platform
import re
import sys
import zipfile
from dataclasses import dataclass
from typing import Any

from engines.native.abi import ABI_VERSION
from wm.errors import InvalidCode

MANIFEST = "manifest.json"
#: ABI versions this engine loads (the current one and, once there is one, its predecessor).
SUPPORTED_ABI_VERSIONS = (ABI_VERSION,)
#: RIDs this engine is built and tested for.
SUPPORTED_RIDS = ("linux-x64", "linux-arm64")
ISOLATION_MODES = ("in-process", "subprocess")
#: Largest library accepted (uncompressed), and largest manifest.
MAX_LIBRARY_BYTES = 256 * 1024 * 1024
MAX_MANIFEST_BYTES = 64 * 1024
_LIBRARY_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ARCHITECTURES = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}


@dataclass(frozen=True)
class Manifest:
    abi_version: int
    library: str
    entry_point: str = "Process"
    free_result: str = "FreeResult"
    isolation: str | None = None
    #: The optional health-probe export: a library without it has no probe.
    probe: str = "Probe"


@dataclass(frozen=True)
class Package:
    manifest: Manifest
    rid: str
    #: Path of the library inside the zip, and its bytes.
    entry: str
    library: bytes


def running_rid() -> str:
    """The RID of this process: ``<os>-<arch>`` as .NET names them (``linux-x64``, …)."""
    system = {"linux": "linux", "darwin": "osx", "win32": "win"}.get(sys.platform, sys.platform)
    machine = platform.machine().lower()
    return f"{system}-{_ARCHITECTURES.get(machine, machine)}"


def library_file(library: str) -> str:
    """The platform's file name of ``library``: ``lib<x>.so``, ``<x>.dll``, ``lib<x>.dylib``."""
    if sys.platform == "win32":
        return f"{library}.dll"
    if sys.platform == "darwin":
        return f"lib{library}.dylib"
    return f"lib{library}.so"


def read_package(code: bytes, rid: str | None = None) -> Package:
    """Check a worker zip and take this machine's library out of it; every refusal is an
    :class:`InvalidCode` naming the defect."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(code))
    except (zipfile.BadZipFile, ValueError) as exc:
        raise InvalidCode(
            f"a native worker must be a zip file with {MANIFEST} and runtimes/<rid>/native/: {exc}"
        ) from exc
    with archive:
        manifest = parse_manifest(_member(archive, MANIFEST, MAX_MANIFEST_BYTES, "manifest"))
        rid = rid or running_rid()
        entry = f"runtimes/{rid}/native/{library_file(manifest.library)}"
        if entry not in archive.namelist():
            raise InvalidCode(_missing_entry(archive, entry, rid))
        return Package(manifest, rid, entry, _member(archive, entry, MAX_LIBRARY_BYTES, "library"))


def _member(archive: zipfile.ZipFile, name: str, limit: int, what: str) -> bytes:
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise InvalidCode(
            f"the worker zip has no {name} at its root; a native worker needs one "
            '(e.g. {"abi_version": 1, "library": "myworker"})'
        ) from None
    if info.file_size > limit:
        raise InvalidCode(
            f"the worker zip's {what} {name} is {info.file_size} bytes; at most {limit}"
        )
    try:
        with archive.open(info) as member:
            data = member.read(limit + 1)
    except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError) as exc:
        raise InvalidCode(f"the worker zip's {name} cannot be read: {exc}") from exc
    if len(data) > limit:
        raise InvalidCode(f"the worker zip's {what} {name} is over {limit} bytes")
    return data


def parse_manifest(raw: bytes) -> Manifest:
    """Check ``manifest.json``; fields beyond those of ABI v1 are ignored."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidCode(f"{MANIFEST} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise InvalidCode(f"{MANIFEST} must be a JSON object")
    version = doc.get("abi_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidCode(f"{MANIFEST} needs an integer abi_version; found {version!r}")
    if version not in SUPPORTED_ABI_VERSIONS:
        supported = ", ".join(map(str, SUPPORTED_ABI_VERSIONS))
        raise InvalidCode(
            f"{MANIFEST} declares abi_version {version}, which this engine does not support; "
            f"supported: {supported}"
        )
    library = doc.get("library")
    if not isinstance(library, str) or not library:
        raise InvalidCode(f"{MANIFEST} needs a non-empty library name; found {library!r}")
    if not _LIBRARY_NAME.match(library) or library in (".", ".."):
        raise InvalidCode(
            f"{MANIFEST} library {library!r} is not a valid name: use only [A-Za-z0-9_.-]"
        )
    return Manifest(
        version,
        library,
        _symbol(doc, "entry_point", "Process"),
        _symbol(doc, "free_result", "FreeResult"),
        _isolation(doc.get("isolation")),
        _symbol(doc, "probe", "Probe"),
    )


def _symbol(doc: dict[str, Any], key: str, default: str) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str) or not _SYMBOL.match(value):
        raise InvalidCode(f"{MANIFEST} {key} {value!r} is not a C identifier")
    return value


def _isolation(value: Any) -> str | None:
    if value is None:
        return None
    if value not in ISOLATION_MODES:
        raise InvalidCode(
            f"{MANIFEST} isolation {value!r} is not one of {', '.join(ISOLATION_MODES)}"
        )
    return str(value)


def _missing_entry(archive: zipfile.ZipFile, entry: str, rid: str) -> str:
    present = sorted(
        {
            parts[1]
            for parts in (name.split("/") for name in archive.namelist())
            if len(parts) >= 4 and parts[0] == "runtimes" and parts[2] == "native" and parts[3]
        }
    )
    return (
        f"the worker zip has no {entry}: no library for this machine ({rid}); "
        f"it has entries for: {', '.join(present) or 'none'}; "
        f"supported architectures: {', '.join(SUPPORTED_RIDS)}"
    )
