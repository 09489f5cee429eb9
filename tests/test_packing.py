"""Commands packed by hiredis alone (``wm.state.packing``) are the bytes redis-py sends."""

from __future__ import annotations

import random
import string
from typing import Any

import pytest
import redis
from redis._parsers import Encoder
from redis.connection import PythonRespSerializer

from tests.conftest import make_settings
from wm.dataplane.app import make_app
from wm.state.connection import pooled_client, redis_for
from wm.state.packing import PACKER

_REDIS_PY = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


def _argument(rng: random.Random) -> Any:
    kind = rng.choice(["str", "bytes", "int", "float", "long"])
    if kind == "str":
        return "".join(rng.choice(string.printable + "éλ→\u2028") for _ in range(rng.randrange(20)))
    if kind == "bytes":
        return rng.randbytes(rng.randrange(20))
    if kind == "int":
        return rng.randrange(-(10**20), 10**20)
    if kind == "float":
        return rng.choice([rng.uniform(-1e6, 1e6), rng.random() * 10 ** rng.randrange(-9, 20)])
    return "x" * rng.randrange(5990, 6010)  # around redis-py's buffer cut-off


def test_a_command_packs_to_the_bytes_redis_py_sends(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(500):
        args = ("EVAL", *(_argument(rng) for _ in range(rng.randrange(12))))
        assert b"".join(PACKER.pack(*args)) == b"".join(_REDIS_PY.pack(*args)), args


def test_what_hiredis_does_not_take_is_packed_or_refused_as_redis_py_does() -> None:
    for args in [("SCRIPT LOAD", "return 1"), (b"CONFIG GET", "x"), ("SET", memoryview(b"v"))]:
        assert b"".join(PACKER.pack(*args)) == b"".join(_REDIS_PY.pack(*args))
    assert PACKER.pack("SCRIPT LOAD", "x")[0].startswith(b"*3\r\n$6\r\nSCRIPT\r\n$4\r\nLOAD")
    for bad in [None, True, object()]:
        with pytest.raises(redis.DataError, match="Invalid input of type"):
            PACKER.pack("SET", "k", bad)
    with pytest.raises(UnicodeEncodeError):
        PACKER.pack("SET", "k", "\udc80")


def test_the_state_store_and_the_broker_pack_with_it(redis_ok: None) -> None:
    settings = make_settings("sqlite://")
    clients = [redis_for(settings), pooled_client(settings.broker_url)]
    with make_app(settings).connection_for_write() as connection:
        clients.append(connection.default_channel.client)
        for client in clients:
            assert client.connection_pool.connection_kwargs["command_packer"] is PACKER
            assert client.ping()
