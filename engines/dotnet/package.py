"""What an ``application/x-dotnet-dll`` worker is shipped as: a bare DLL, or a nupkg (a zip)
whose ``lib/<tfm>/`` folders hold the worker DLL and its sibling dependencies. The best
folder for the running runtime is picked the way NuGet does for a .NET app: the highest
``net<N>.0`` not above the runtime, then ``netcoreapp``, then ``netstandard``.
"""

from __future__ import annotations

import io
import re
import zipfile
from dataclasses import dataclass
from pathlib import PurePosixPath

from defusedxml import ElementTree

from wm.errors import InvalidCode

#: Largest package accepted, unpacked.
MAX_UNPACKED_BYTES = 256 * 1024 * 1024
DEVKIT_FILE = "Virtufin.Worker.DevKit.dll"
_TFM = re.compile(r"^(net|netcoreapp|netstandard)(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True)
class Package:
    """The worker's files: ``main`` is the worker DLL, ``files`` every DLL to offer its
    context (the main one included), by file name."""

    main: str
    files: dict[str, bytes]
    tfm: str


def read_package(code: bytes, runtime_major: int) -> Package:
    """The worker's DLLs from a bare DLL or a nupkg; :class:`InvalidCode` naming what is
    wrong."""
    if code[:2] == b"MZ":
        return Package("Worker.dll", {"Worker.dll": code}, "")
    if code[:2] != b"PK":
        raise InvalidCode(
            "application/x-dotnet-dll code must be a .NET DLL (a PE file starting with 'MZ') or "
            f"a nupkg/zip with lib/<tfm>/ entries; it starts with {code[:4]!r}"
        )
    try:
        archive = zipfile.ZipFile(io.BytesIO(code))
        infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError) as exc:
        raise InvalidCode(f"the .NET package is not a valid zip: {exc}") from exc
    if sum(info.file_size for info in infos) > MAX_UNPACKED_BYTES:
        raise InvalidCode(f"the .NET package unpacks to more than {MAX_UNPACKED_BYTES} bytes")
    folders: dict[str, list[zipfile.ZipInfo]] = {}
    for info in infos:
        parts = PurePosixPath(info.filename).parts
        if len(parts) == 3 and parts[0].lower() == "lib" and parts[2].lower().endswith(".dll"):
            folders.setdefault(parts[1].lower(), []).append(info)
    if not folders:
        raise InvalidCode("the .NET package has no lib/<tfm>/*.dll entries")
    tfm = best_tfm(list(folders), runtime_major)
    try:
        files = {
            PurePosixPath(info.filename).name: archive.read(info)
            for info in folders[tfm]
            if PurePosixPath(info.filename).name != DEVKIT_FILE  # the host's copy is used
        }
        package_id = _package_id(archive)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise InvalidCode(f"the .NET package cannot be read: {exc}") from exc
    return Package(_main(files, package_id, tfm), files, tfm)


def best_tfm(folders: list[str], runtime_major: int) -> str:
    """The folder NuGet would pick for a net``runtime_major``.0 app."""
    ranked: list[tuple[tuple[int, int, int], str]] = []
    for folder in folders:
        match = _TFM.match(folder)
        if match is None:
            continue
        family, major, minor = match.group(1), int(match.group(2)), int(match.group(3) or 0)
        if family == "net" and "." in folder and 5 <= major <= runtime_major:
            ranked.append(((3, major, minor), folder))
        elif family == "netcoreapp" and major <= 3:
            ranked.append(((2, major, minor), folder))
        elif family == "netstandard" and (major, minor) <= (2, 1):
            ranked.append(((1, major, minor), folder))
    if not ranked:
        raise InvalidCode(
            f"no lib/ folder of the .NET package targets a framework that .NET {runtime_major} "
            f"runs (found: {', '.join(sorted(folders))}; usable: net5.0–net{runtime_major}.0, "
            "netcoreapp, netstandard)"
        )
    return max(ranked)[1]


def _package_id(archive: zipfile.ZipFile) -> str | None:
    for name in archive.namelist():
        if "/" not in name and name.lower().endswith(".nuspec"):
            try:
                root = ElementTree.fromstring(archive.read(name))
            except ElementTree.ParseError as exc:
                raise InvalidCode(f"the package's {name} is not valid XML: {exc}") from exc
            for element in root.iter():
                if element.tag.rsplit("}", 1)[-1] == "id" and element.text:
                    return str(element.text).strip()
    return None


def _main(files: dict[str, bytes], package_id: str | None, tfm: str) -> str:
    """The worker DLL: the one named after the package id, else the only one."""
    if package_id is not None:
        for name in files:
            if name.lower() == f"{package_id.lower()}.dll":
                return name
    if len(files) == 1:
        return next(iter(files))
    named = f" or named after its id {package_id!r}" if package_id else ""
    raise InvalidCode(
        f"the .NET package's lib/{tfm}/ holds {len(files)} DLLs ({', '.join(sorted(files))}) "
        f"and none is the worker: give the nupkg a .nuspec whose <id> is the worker DLL's "
        f"name{named}"
    )
