"""Commands packed for Redis by hiredis alone.

redis-py packs a command with hiredis too, but first converts each argument in Python (an
``Encoder.encode`` call and a generator step each): a node's take of the next message, with
its twenty-odd arguments, cost 21 µs to pack and hiredis alone 4 µs; an acknowledgement 13 µs
against 2 µs (2-vCPU host, ``json.dumps`` of a small dict 3.5 µs). Every message pays for
both in the node's main process, and a delivery's record pays as much in its pool process.

hiredis packs ``str`` (UTF-8, a lone surrogate refused as redis-py refuses it), ``bytes``,
``int`` and ``float`` to the same bytes redis-py sends. What it does not take (a
``memoryview``, a type neither accepts) goes to redis-py's own packer, which converts it or
raises its ``DataError``; so does a command name with a space (``"SCRIPT LOAD"``), which
redis-py splits into its words.
"""

from __future__ import annotations

from typing import Any

import hiredis
from redis._parsers import Encoder
from redis.connection import PythonRespSerializer

#: redis-py's default: longer arguments are sent as buffers of their own.
_BUFFER_CUTOFF = 6000


class Packer:
    """A redis-py command packer (a connection's ``command_packer``) that hands a command to
    ``hiredis.pack_command`` as it is, and what hiredis refuses to redis-py's own packer."""

    def __init__(self) -> None:
        encode = Encoder("utf-8", "strict", False).encode  # type: ignore[no-untyped-call,unused-ignore]
        self.fallback = PythonRespSerializer(_BUFFER_CUTOFF, encode)  # type: ignore[no-untyped-call,unused-ignore]

    def pack(self, *args: Any) -> list[bytes]:
        name = args[0]
        if isinstance(name, str):
            spaced = " " in name
        else:
            spaced = not isinstance(name, bytes) or b" " in name
        if not spaced:
            try:
                return [hiredis.pack_command(args)]
            except TypeError:
                pass
        return list(self.fallback.pack(*args))  # type: ignore[no-untyped-call,unused-ignore]


#: For every connection that encodes as UTF-8 (redis-py's default), as ``command_packer``.
PACKER = Packer()


def connection_options() -> dict[str, Any]:
    """What to add to a redis-py connection's options to pack with :data:`PACKER`."""
    return {"command_packer": PACKER}
