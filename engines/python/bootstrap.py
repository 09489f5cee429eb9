"""Entry script of the sandboxed child: ``python -I -S -B bootstrap.py READ_FD WRITE_FD``.

The isolated flags leave nothing but the standard library on ``sys.path``. This script reads
the INIT frame with the standard library only (before ``engines.childproc.frames`` can be
imported: its header and kind are restated here, and a test holds them equal), puts exactly
the directories the host named on ``sys.path``, and registers the ``engines`` and ``wm``
packages as bare package objects: their ``__init__`` modules import the host side and the
whole platform (SQLAlchemy, Celery, sockets), none of which belongs in the sandbox. Then the
runner takes over.

The child never goes through interpreter finalization: CPython drops the audit hooks before
it frees the last objects (those reachable from ``sys`` and ``builtins``), so a worker
object's ``__del__`` run then would be unguarded. The child ends with ``os._exit`` instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
import traceback
from typing import Any, NoReturn

#: ``engines.childproc.frames.HEADER`` and ``INIT``.
_HEADER = struct.Struct("<cI")
_INIT = b"I"


def _read_exact(fd: int, size: int) -> bytes:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        chunk = os.read(fd, remaining)
        if not chunk:
            raise SystemExit("host closed the protocol pipe before the init frame")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _read_init(fd: int) -> dict[str, Any]:
    """The launch configuration, with the worker's source as ``code``."""
    kind, size = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    if kind != _INIT:
        raise SystemExit(f"expected the init frame, got a {kind!r} frame")
    header, _, code = _read_exact(fd, size).partition(b"\n")
    config: dict[str, Any] = json.loads(header)
    config["code"] = code.decode("utf-8")
    return config


def _exit_now(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main() -> None:
    read_fd, write_fd = int(sys.argv[1]), int(sys.argv[2])
    config = _read_init(read_fd)
    sys.path[:] = config["sys_path"]
    for name, directory in config["packages"].items():
        package = type(sys)(name)
        package.__path__ = [directory]
        sys.modules[name] = package
    from engines.python.runner import run

    run(config, read_fd, write_fd)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        _exit_now(1)
    _exit_now(0)
