"""What the test suite needs from this machine, checked without root and without the project
installed (the standard library only): Debian packages, and PostgreSQL, Redis and RabbitMQ
answering where the tests look for them (``TEST_PG_ADMIN_URL``, ``TEST_REDIS_HOST``,
``TEST_AMQP_URL``).

A Redis that is installed but not running is started, as this user, with nothing on disk.
Anything else missing is named in one line with the command that provides it, and the exit
code is 1. ``--packages`` prints only the missing Debian packages' names (``.ci/run``
installs them as root).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

#: Debian package → how to tell it is installed (a command on PATH, or a file).
PACKAGES = {
    "redis-server": "redis-server",
    "redis-tools": "redis-cli",  # the cluster failover test forms its cluster with it
    "postgresql": "pg_ctlcluster",
    "rabbitmq-server": "rabbitmq-server",
    "docker-compose": "docker-compose",
    "util-linux": "unshare",
    "openssl": "openssl",
    "bubblewrap": "bwrap",
    "make": "make",
    "gcc": "gcc",
    "g++": "g++",
    # the native engine's kit: example workers are built, generated code checked against flatc
    "flatbuffers-compiler": "flatc",
    "libflatbuffers-dev": "/usr/include/flatbuffers/flatbuffers.h",
    # the .NET engines: Mono's C# compiler and reference assemblies
    "mono-devel": "/usr/lib/mono/4.5/mcs.exe",
    "libseccomp2": "libseccomp.so.2",
    # the admin API's /docs rendered in a real headless browser (tests/test_api_docs.py)
    "chromium": "chromium",
    # ... and the worker console driven in it by Selenium (tests/test_console.py)
    "chromium-driver": "chromedriver",
}
DEFAULTS = {
    "TEST_PG_ADMIN_URL": "postgresql+psycopg://root@127.0.0.1:5432/test",
    "TEST_REDIS_HOST": "redis://127.0.0.1:6379",
    "TEST_AMQP_URL": "amqp://guest:guest@127.0.0.1:5672//",
}
HOW = "sudo bash .ci/run installs and starts everything"


def missing_packages() -> list[str]:
    return [name for name, probe in PACKAGES.items() if not _installed(probe)]


def _installed(probe: str) -> bool:
    if probe.startswith("/"):
        return Path(probe).exists()
    if probe.endswith(".so.2"):
        found = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True)
        return probe in found.stdout
    return shutil.which(probe) is not None


def _address(variable: str, port: int) -> tuple[str, int]:
    parts = urlsplit(os.environ.get(variable, DEFAULTS[variable]))
    return parts.hostname or "127.0.0.1", parts.port or port


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _start_redis(host: str, port: int) -> bool:
    """A Redis of this user's, keeping nothing on disk; True once it answers."""
    if shutil.which("redis-server") is None or host not in ("127.0.0.1", "localhost"):
        return False
    where = os.environ.get("TMPDIR", "/tmp")
    options = ["--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    started = subprocess.run(
        ["redis-server", "--daemonize", "yes", *options, "--dir", where], capture_output=True
    )
    for _ in range(50):
        if started.returncode == 0 and _answers(host, port):
            print(f"preflight: started a Redis on {host}:{port} (this user's, nothing on disk)")
            return True
        time.sleep(0.1)
    return False


def problems() -> list[str]:
    found = []
    packages = missing_packages()
    if packages:
        names = " ".join(packages)
        found.append(
            f"missing Debian packages: {names}; install them with "
            f"`sudo apt-get install -y {names}` ({HOW})"
        )
    services = [
        ("PostgreSQL", "TEST_PG_ADMIN_URL", 5432, "sudo service postgresql start"),
        ("Redis", "TEST_REDIS_HOST", 6379, "redis-server --daemonize yes"),
        ("RabbitMQ", "TEST_AMQP_URL", 5672, "sudo rabbitmq-server -detached"),
    ]
    for name, variable, port, start in services:
        host, port = _address(variable, port)
        if _answers(host, port) or (name == "Redis" and _start_redis(host, port)):
            continue
        found.append(
            f"{name} does not answer on {host}:{port} ({variable}): start it with `{start}` "
            f"({HOW}), or point {variable} at one"
        )
    return found


def main(argv: list[str]) -> int:
    if argv[1:] == ["--packages"]:
        print(" ".join(missing_packages()))
        return 0
    found = problems()
    for line in found:
        print(f"preflight: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
