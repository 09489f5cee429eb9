"""Build tools for .NET workers where no .NET SDK is installed: ``python -m engines.dotnet``.

* ``devkit`` builds the DevKit (cached by hash) and prints the path of
  ``Virtufin.Worker.DevKit.dll``, to reference from a worker project.
* ``compile SOURCE... -o Worker.dll [-r DEP.dll]`` compiles worker sources against the DevKit
  with the engine's own compiler (C# 7.2).
* ``pack DLL... -o worker.nupkg --id ID [--tfm netstandard2.0]`` writes a nupkg whose
  ``lib/<tfm>/`` holds the DLLs, the first named after ``--id``: what
  ``application/x-dotnet-dll`` accepts.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path
from xml.sax.saxutils import escape

from engines.dotnet import runtime as dotnet
from wm.config import Settings
from wm.errors import WorkManagerError

NUSPEC = """<?xml version="1.0" encoding="utf-8"?>
<package xmlns="http://schemas.microsoft.com/packaging/2013/05/nuspec.xsd">
  <metadata>
    <id>{id}</id>
    <version>{version}</version>
    <authors>{authors}</authors>
    <description>A WorkManager worker.</description>
  </metadata>
</package>
"""


def pack(dlls: list[Path], output: Path, package_id: str, tfm: str, version: str) -> None:
    if not dlls:
        raise ValueError("pack needs at least one DLL")
    main = dlls[0]
    with zipfile.ZipFile(output, "w", zipfile.ZIP_DEFLATED) as archive:
        metadata = {"id": escape(package_id), "version": escape(version), "authors": "workmanager"}
        archive.writestr(f"{package_id}.nuspec", NUSPEC.format(**metadata))
        archive.write(main, f"lib/{tfm}/{package_id}.dll")
        for dll in dlls[1:]:
            archive.write(dll, f"lib/{tfm}/{dll.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.dotnet", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("devkit", help="build the DevKit and print its DLL's path")
    compile_ = commands.add_parser("compile", help="compile worker sources into a DLL")
    compile_.add_argument("sources", nargs="+", type=Path)
    compile_.add_argument("-o", "--output", type=Path, required=True)
    compile_.add_argument("-r", "--reference", type=Path, action="append", default=[])
    pack_ = commands.add_parser("pack", help="pack DLLs into a worker nupkg")
    pack_.add_argument("dlls", nargs="+", type=Path)
    pack_.add_argument("-o", "--output", type=Path, required=True)
    pack_.add_argument("--id", required=True, help="package id: the worker DLL's name")
    pack_.add_argument("--tfm", default="netstandard2.0", help="target framework folder")
    pack_.add_argument("--version", default="1.0.0")
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            pack(args.dlls, args.output, args.id, args.tfm, args.version)
            print(args.output)
            return 0
        rt = dotnet.runtime(Settings.from_env())
        if args.command == "devkit":
            print(rt.devkit)
        else:
            diagnostics = rt.compile(args.sources, args.output.resolve(), args.reference)
            if diagnostics.strip():
                print(diagnostics.strip(), file=sys.stderr)
            print(args.output)
    except (WorkManagerError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
